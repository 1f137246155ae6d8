"""Hangar's Redis broker transport: kombu's, less a round trip per message taken without acks.

portal/celery.py names it for redis:// and rediss:// broker URLs, so only a process whose
broker is Redis imports it (and kombu's Redis transport)."""

from kombu.transport import redis


class UnrecordedAckQoS(redis.QoS):
    """kombu's Redis ack emulation, less the ack of a message it never recorded. A message taken
    from a queue consumed without acks (`portal.celery.taken_without_ack`) is never written to
    the unacked index, but Celery still acks it once its task is accepted, and kombu's virtual
    channels do not tell such a consumer's messages apart (`Channel.no_ack_consumers` is AMQP's):
    each ack sent a MULTI/ZREM/HDEL/EXEC for keys that were never written, a round trip in the
    worker's event loop before it read its next message, about two a job (every dispatch an agent
    takes, every wake-up the scheduler takes), and the ack's tag stayed in the channel's set of
    acked tags for the life of the process. A message that was recorded (the notifier's queue is
    acknowledged) is acked as before. A reject is the same: for a message never recorded there is
    nothing to erase or to put back (kombu's requeue reads it from the unacked index)."""

    def ack(self, delivery_tag):
        if delivery_tag in self._delivered:
            super().ack(delivery_tag)

    def reject(self, delivery_tag, requeue=False):
        if delivery_tag in self._delivered:
            super().reject(delivery_tag, requeue=requeue)


class Channel(redis.Channel):
    QoS = UnrecordedAckQoS


class Transport(redis.Transport):
    Channel = Channel
