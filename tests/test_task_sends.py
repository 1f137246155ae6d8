"""Tasks sent by name (portal/celery.py): their results are never read, so a send asks the
result backend for nothing (on Redis, a subscription to the result's channel per message).
And which queues' messages are kept until acknowledged: the notifier's, not the scheduler's
wake-ups nor a node's starts (the rows are the record; portal/celery.py)."""

import pytest
from kombu import Connection

from portal.celery import SCHEDULER_QUEUE, app, ping, taken_without_ack
from portal.redisbroker import UnrecordedAckQoS
from tests.services import PrivateRedis


def calls_to_the_result_backend(monkeypatch) -> list[str]:
    calls = []
    monkeypatch.setattr(app.backend, "on_task_call", lambda producer, task_id: calls.append(task_id))
    return calls


def test_a_task_sent_by_name_asks_the_result_backend_for_nothing(monkeypatch):
    calls = calls_to_the_result_backend(monkeypatch)
    result = app.send_task("hangar.close_run", kwargs={"job_id": 0}, queue="hangar.test-sends")

    assert calls == []
    assert result.ignored


def test_a_task_whose_result_is_read_is_still_followed(monkeypatch):
    calls = calls_to_the_result_backend(monkeypatch)
    result = ping.apply_async(args=[0.0], queue="hangar.test-sends")  # bench/start_latency.py reads its result

    assert calls == [result.id]
    sent = app.send_task("hangar.ping", args=[0.0], queue="hangar.test-sends", ignore_result=False)
    assert calls == [result.id, sent.id]


def left_to_redeliver(queue_name: str) -> int:
    """A worker's consumer (as Celery makes it from the app's queues) takes one message from
    the queue and its connection drops before any ack: how many messages the queue then holds
    again (kombu puts back what was taken but not acknowledged)."""
    queue = app.amqp.queues[queue_name]  # a queue not declared in the settings is made as a worker names it
    with Connection("memory://") as connection:
        channel = connection.channel()
        connection.Producer(channel).publish(
            {"wake": True}, exchange=queue.exchange, routing_key=queue.routing_key, declare=[queue]
        )
        taken = []
        consumer = app.amqp.TaskConsumer(channel, queues=[queue], accept=["json"])
        consumer.register_callback(lambda body, message: taken.append(body))
        with consumer:
            connection.drain_events(timeout=5)
        assert taken == [{"wake": True}]
        channel.qos.restore_unacked()
        bound = queue(channel)
        kept = bound.queue_declare(passive=True).message_count
        bound.purge()  # the memory transport's queues outlive the connection
        return kept


@pytest.mark.parametrize("queue", [SCHEDULER_QUEUE, "hangar.node.test-sends"])
def test_a_message_taken_from_a_queue_taken_without_acks_is_not_kept_for_redelivery(monkeypatch, queue):
    """As the scheduler's and an agent's commands declare their queues: a wake-up is answered
    by the next pass anyway, and an attempt not started in time is ended and its job requeued."""
    # As a sender to it made it (acknowledged), in this test only: put back after.
    monkeypatch.setitem(app.amqp.queues, queue, app.amqp.queues.new_missing(queue))
    assert left_to_redeliver(queue) == 1  # the same message, taken from the queue a sender made
    assert taken_without_ack(queue) == queue
    declared = app.amqp.queues[queue]  # bound as its senders bind it (their exchange, their routing key)
    assert (declared.exchange.name, declared.routing_key) == (queue, queue)
    assert left_to_redeliver(queue) == 0


def test_a_message_to_the_notifier_is_kept_until_acknowledged():
    assert left_to_redeliver("hangar.tracking") == 1


def test_on_redis_a_message_taken_without_acks_is_acked_without_a_round_trip(monkeypatch):
    """Celery acks every message its worker accepts; on Redis kombu's ack erases the message
    from the unacked index (MULTI/ZREM/HDEL/EXEC). A message taken without acks was never
    written there: its ack costs no command (before, one round trip per dispatch an agent
    took and per wake-up the scheduler took), nor does its reject. The notifier's, recorded, is still erased."""
    if missing := PrivateRedis.missing():
        pytest.skip(missing)
    queue = "hangar.node.test-acks"
    monkeypatch.setitem(app.amqp.queues, queue, app.amqp.queues.new_missing(queue))
    taken_without_ack(queue)
    queues = [app.amqp.queues[queue], app.amqp.queues["hangar.tracking"]]
    with PrivateRedis() as redis, Connection(redis.url) as connection:
        channel = connection.channel()
        assert isinstance(channel.qos, UnrecordedAckQoS)  # the broker URL's scheme names Hangar's transport
        producer = connection.Producer(channel)
        for declared in [queues[0], queues[1], queues[0]]:
            producer.publish(
                {"to": declared.name}, exchange=declared.exchange, routing_key=declared.routing_key, declare=[declared]
            )
        channel.client.config_resetstat()
        taken = []

        def take(body, message):
            taken.append(body["to"])
            if taken.count(queue) == 2:  # a reject of a message never recorded costs no command either
                message.reject()
            else:
                message.ack()

        consumer = app.amqp.TaskConsumer(channel, queues=queues, accept=["json"])
        consumer.register_callback(take)
        with consumer:
            while len(taken) < 3:
                connection.drain_events(timeout=5)
        calls = {name: stat["calls"] for name, stat in channel.client.info("commandstats").items()}

    assert sorted(taken) == sorted(["hangar.tracking", queue, queue])
    # The notifier's message recorded as unacknowledged (ZADD, HSET), then erased (ZREM, HDEL); the others neither.
    assert [calls.get(f"cmdstat_{c}", 0) for c in ("zadd", "hset", "zrem", "hdel")] == [1, 1, 1, 1]
