"""The Celery app shared by the web process, the scheduler and every node agent.

Attempt tasks are only wake-ups: the database holds each attempt's state. So
tasks are acknowledged early and a worker takes one message at a time; a job
that runs for days is never redelivered by a broker's visibility timeout.
"""

import gc
import os
import time
import uuid
import warnings

from celery import Celery
from celery.signals import worker_ready
from kombu.exceptions import ChannelError
from kombu.transport import TRANSPORT_ALIASES, filesystem
from kombu.utils.json import dumps, loads

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "portal.settings")

# Agents often run as root on GPU machines; the jobs they start are what matters.
warnings.filterwarnings("ignore", message=".*superuser privileges.*")


class AtomicFilesystemChannel(filesystem.Channel):
    """kombu's filesystem channel, publishing by rename. kombu's own `_put` creates the
    message file and only then writes it; a consumer polling in between takes an empty
    message and its worker dies ("Unrecoverable error: JSONDecodeError", seen in the
    scheduler drill). Consumers skip the `.partial` name until the rename completes it."""

    def _put(self, queue, payload, **kwargs):
        name = f"{round(time.monotonic() * 1000)}_{uuid.uuid4()}.{queue}.msg"
        final = os.path.join(self.data_folder_out, name)
        try:
            with open(final + ".partial", "wb") as f:
                f.write(dumps(payload).encode())
            os.replace(final + ".partial", final)
        except OSError as exc:
            raise ChannelError(f"cannot add {final!r} to the broker folder") from exc

    def _queue_bind(self, exchange, routing_key, pattern, queue):
        """kombu's creates an exchange's table file, then locks it: a process starting at the
        same moment can lock it in between, read it empty and die ("Unrecoverable error:
        JSONDecodeError" in `_queue_bind`, seen when `manage.py up` started its workers).
        Here every binder opens the file (made if missing), locks it, then reads it; an
        empty table is a new one."""
        file = self._exchange_file(exchange)
        self.control_folder.mkdir(exist_ok=True)
        entry = filesystem.exchange_queue_t(routing_key or "", pattern or "", queue or "")
        try:
            with file.open("a+b", buffering=0) as table:
                filesystem.lock(table, filesystem.LOCK_EX)
                try:
                    table.seek(0)
                    queues = self._entries(table.read())
                    if entry not in queues:
                        table.truncate(0)  # appended to after this: the table is written from 0
                        table.write(dumps([entry, *queues]).encode())
                finally:
                    filesystem.unlock(table)
        except OSError as exc:
            raise ChannelError(f"Cannot open {file}") from exc

    def get_table(self, exchange):
        """A table being made by `_queue_bind` (empty until it is written) has no queues yet."""
        file = self._exchange_file(exchange)
        try:
            with file.open("rb") as table:
                filesystem.lock(table, filesystem.LOCK_SH)
                try:
                    return self._entries(table.read())
                finally:
                    filesystem.unlock(table)
        except FileNotFoundError:
            return []
        except OSError as exc:
            raise ChannelError(f"Cannot open {file}") from exc

    @staticmethod
    def _entries(content: bytes) -> list:
        return [filesystem.exchange_queue_t(*q) for q in loads(content.decode())] if content else []


class AtomicFilesystemTransport(filesystem.Transport):
    Channel = AtomicFilesystemChannel


# The embedded broker's URL stays filesystem://; its scheme names this transport.
TRANSPORT_ALIASES["filesystem"] = "portal.celery:AtomicFilesystemTransport"


# A Redis broker's URLs (redis://, rediss://) name Hangar's Redis transport (portal/redisbroker.py),
# imported only where the broker is Redis.
TRANSPORT_ALIASES["redis"] = TRANSPORT_ALIASES["rediss"] = "portal.redisbroker:Transport"


def settle_configuration(sender, **_) -> None:
    """Every Celery setting's value, kept as Celery's own (its first map): a setting read
    (several each send and each message taken) is then one dictionary look-up. Left to
    itself, Celery looks one up in Django's settings under each of its names, each miss an
    AttributeError, before its default: ~20 % of a send's CPU (0.98 -> 0.85 ms a send here,
    with the argument reprs above 0.71). Django's settings are not changed while a process
    runs; what reads them anew (the broker's URL in a property, the time zone) still does.

    Written into that map itself, not through `conf.update()`: an update also calls its
    observers, and AMQP's rebuilds its router, a cached property. This runs in whichever
    thread reads the configuration first, holding it: an agent whose waker thread got here
    while its main thread was making `app.amqp.queues` (and waited for the configuration)
    hung for ever (bench/throughput.py: one agent of four took no job). The values are the
    ones already read, so no observer has anything to do."""
    from celery.app.defaults import DEFAULTS

    conf = sender.conf
    conf.changes.update({key: conf[key] for key in DEFAULTS})


class HangarCelery(Celery):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.on_after_configure.connect(settle_configuration, weak=False)

    def send_task(self, name, args=None, kwargs=None, **options):
        """A task sent by name keeps its result as the tasks' setting says (task_ignore_result),
        as one sent by its object does (Task.apply_async passes its own). Celery's default is to
        keep it: each send then subscribed to the result's channel on a Redis result backend and
        dropped it at the next send, two round trips and ~0.4 ms of CPU per message for a result
        no one reads (every dispatch, wake-up and MLflow update is sent by name)."""
        options.setdefault("ignore_result", self.conf.task_ignore_result)
        # The arguments as the message's headers show them (a worker's log, a monitor): Celery
        # writes them with its saferepr, made for any object, ~0.1 ms a send; Hangar sends ids,
        # times and names, which repr() writes alike, cut to the same length.
        options.setdefault("argsrepr", repr(args or ())[: self.amqp.argsrepr_maxsize])
        options.setdefault("kwargsrepr", repr(kwargs or {})[: self.amqp.kwargsrepr_maxsize])
        return super().send_task(name, args, kwargs, **options)


SCHEDULER_QUEUE = "hangar.scheduler"

app = HangarCelery("hangar")
app.config_from_object("django.conf:settings", namespace="CELERY")
app.conf.update(
    task_acks_late=False,
    worker_prefetch_multiplier=1,
    task_default_queue=SCHEDULER_QUEUE,
    task_create_missing_queues=True,
    broker_connection_retry_on_startup=True,
    # A broker restart must not end an agent or the scheduler: they reconnect for as
    # long as it takes (the default gives up after 100 tries), and running attempts
    # keep running meanwhile (their state is in the database, not in the message).
    broker_connection_retry=True,
    broker_connection_max_retries=None,
    worker_cancel_long_running_tasks_on_connection_loss=False,
    worker_hijack_root_logger=False,
    worker_send_task_events=False,
    task_serializer="json",
    accept_content=["json"],
)


def taken_without_ack(queue: str) -> str:
    """Have this process's worker take `queue`'s messages without acks; the queue's name, for
    the worker's --queues. The scheduler's queue and each node's are taken so (their commands
    call this); the notifier's (run updates, webhook deliveries) is acknowledged early.

    A wake-up of the scheduler is a request for a pass that the next one, or the periodic
    pass, answers as well; a node's message says "start this rank", whose row is the record.
    What an ack kept was a message taken but not yet started, for redelivery: put back when
    its worker stopped cleanly, else after the broker's visibility timeout (an hour, long
    after the reconciler ended an attempt not started within HANGAR_START_TIMEOUT_SECONDS and
    requeued its job). An agent's message waits unstarted only while all its threads are
    busy, and it has two more than GPUs. On Redis the ack's bookkeeping (the message recorded
    as unacknowledged, then erased) was two round trips before every pass and every start:
    no_ack skips the record, portal/redisbroker.py the erasure."""
    declared = app.amqp.queues.new_missing(queue)  # its exchange and routing key as a sender makes them
    declared.no_ack = True
    app.amqp.queues.add(declared)
    return queue


# Only the scheduler's tasks are found by name here: the agent's (agent/tasks.py) are
# registered by `manage.py agent` alone, and every sender names the task it sends, so
# neither the web nor the scheduler process loads the agent's runtime.
app.autodiscover_tasks(["jobs"])


@worker_ready.connect
def freeze_what_is_loaded(**_) -> None:
    """The agent, the scheduler and the notifier, started: what they loaded (Django, the apps,
    Celery, kombu; 350,000-400,000 objects) stays for the life of the process. gc.freeze()
    moves it out of the cyclic collector's reach, as portal/webserver.py does for the web.
    Before, each full collection walked all of it: one stopped every thread of a process for
    150-360 ms, once or twice a minute in each under bench/throughput.py (the notifier spent
    16 % of its CPU collecting, the scheduler and the agents 4 %); a pass or a hand-off caught
    behind one waited as long. What loads later (MLflow's store, in a background thread: jobs/tracking.py)
    is frozen when it has loaded."""
    gc.collect()
    gc.freeze()


@app.task(name="hangar.ping", ignore_result=False)
def ping(sent_at: float) -> float:
    """A bare task, used by bench/start_latency.py as the broker's round-trip baseline."""
    return sent_at
