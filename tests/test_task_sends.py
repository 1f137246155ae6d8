"""Tasks sent by name (portal/celery.py): their results are never read, so a send asks the
result backend for nothing (on Redis, a subscription to the result's channel per message).
And which queues' messages are kept until acknowledged: the notifier's, not the scheduler's
wake-ups nor a node's starts (the rows are the record; portal/celery.py)."""

import threading

import pytest
from celery.app import amqp
from celery.signals import before_task_publish
from celery.utils.saferepr import saferepr
from kombu import Connection

from portal.celery import SCHEDULER_QUEUE, HangarCelery, app, ping, taken_without_ack
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


def test_a_message_shows_its_arguments_as_celery_would_without_its_saferepr(monkeypatch):
    """Celery's saferepr was ~0.1 ms of each send; repr() writes Hangar's ids, times and names alike."""
    sends = [
        ("hangar.run_attempt", [7, 0], None),  # a dispatch
        ("hangar.schedule", None, {"requested_at": 1764921600.25, "queue_at": None, "clock": "3f2a"}),  # a wake-up
        ("hangar.close_run", None, {"job_id": 3}),
    ]
    expected = [(saferepr(args or ()), saferepr(kwargs or {})) for _, args, kwargs in sends]
    monkeypatch.setattr(amqp, "saferepr", lambda *a, **k: pytest.fail("saferepr called"))
    shown = []

    def headers(sender=None, headers=None, **_):
        shown.append((headers["argsrepr"], headers["kwargsrepr"]))

    before_task_publish.connect(headers)
    try:
        for name, args, kwargs in sends:
            app.send_task(name, args=args, kwargs=kwargs, queue="hangar.test-sends")
        app.send_task("hangar.close_run", args=["x" * 5000], queue="hangar.test-sends")
    finally:
        before_task_publish.disconnect(headers)
    assert shown[:3] == expected
    assert len(shown[3][0]) == app.amqp.argsrepr_maxsize  # cut to Celery's length


def test_celery_reads_its_settings_from_one_table(settings):
    """Every setting in Celery's first map (portal/celery.py settle_configuration): Django's
    own where it sets one, else Celery's default."""
    assert app.conf.task_ignore_result is True  # configured by now
    table = app.conf.changes
    assert table["task_ignore_result"] is settings.CELERY_TASK_IGNORE_RESULT
    assert table["broker_url"] == settings.CELERY_BROKER_URL == app.conf.broker_url
    assert table["task_default_queue"] == SCHEDULER_QUEUE
    assert table["task_always_eager"] is False and table["task_protocol"] == 2  # Celery's defaults


def test_two_threads_reading_a_fresh_configuration_both_go_on():
    """An agent's waker thread read the configuration first while its main thread was making
    the app's queues: settling the configuration must not wait for what that thread holds
    (through conf.update, AMQP's observer rebuilt its router from the queues: both hung)."""
    fresh = HangarCelery("settle-test", set_as_current=False)  # configured at its first read, as in a new process
    fresh.conf.update(task_default_queue="hangar.test-settle")
    others = []

    def making_queues() -> None:  # as `manage.py agent`'s main thread (taken_without_ack)
        fresh.amqp.queues.new_missing("hangar.test-settle-node")

    def first_read_began(sender, **_) -> None:  # in the reading thread, before it settles
        other = threading.Thread(target=making_queues, daemon=True)
        other.start()
        other.join(0.3)  # it now waits for this read, holding what it was making
        others.append(other)

    fresh.on_configure.connect(first_read_began, weak=False)
    reader = threading.Thread(target=lambda: fresh.conf.task_default_queue, daemon=True)  # the waker's send
    reader.start()
    reader.join(10)
    others[0].join(10)
    assert not reader.is_alive() and not others[0].is_alive()
    assert fresh.conf.changes["task_default_queue"] == "hangar.test-settle"


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
