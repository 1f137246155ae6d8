import os
import threading

from celery.signals import worker_shutting_down
from django.conf import settings
from django.core.management.base import BaseCommand, CommandError

from agent import network, reach, runner, sandbox, tasks  # noqa: F401  (tasks: registers what this worker consumes)
from agent.node import Agent, default_node_name
from fleet.gpus import SIMULATED_MODELS, detect_provider
from jobs.models import Environment
from portal.celery import app, taken_without_ack
from portal.multihost import shared_state_problems


class Command(BaseCommand):
    help = "Run this machine's node agent: a Celery worker on the node's queue, plus heartbeats and telemetry."

    def add_arguments(self, parser):
        parser.add_argument("--node", default=os.environ.get("HANGAR_NODE_NAME") or default_node_name())
        parser.add_argument(
            "--simulate",
            action="store_true",
            default=os.environ.get("HANGAR_SIMULATE_GPUS", "") in ("1", "true"),
            help="Use simulated GPUs even if NVML finds real ones.",
        )
        parser.add_argument("--sim-gpus", type=int, default=int(os.environ.get("HANGAR_SIM_GPUS") or 4))
        parser.add_argument("--sim-model", default=os.environ.get("HANGAR_SIM_GPU_MODEL") or "H100")
        parser.add_argument(
            "--accept-inventory",
            action="store_true",
            help="After a deliberate hardware change: the GPUs the driver lists now are the node's "
            "(without it, registered GPUs that vanished keep the node unhealthy).",
        )
        parser.add_argument(
            "--environments",
            default=os.environ.get("HANGAR_NODE_ENVIRONMENTS", ""),
            help="Comma-separated environments this node can run (besides those that run everywhere), e.g. ai.",
        )
        parser.add_argument(
            "--advertise-address",
            default=os.environ.get("HANGAR_NODE_ADDRESS", ""),
            help="The address other nodes reach this one at (MASTER_ADDR of the jobs whose rank 0 runs here); "
            "default: the address of the interface that reaches the database.",
        )
        parser.add_argument(
            "--network-interface",
            default=os.environ.get("HANGAR_NODE_NETWORK_INTERFACE", ""),
            help="The interface the ranks here use for gloo/NCCL (default: the one holding the advertised address).",
        )

    def handle(self, *args, node, simulate, sim_gpus, sim_model, environments, accept_inventory, **options):
        if sim_model not in SIMULATED_MODELS:
            raise CommandError(f"--sim-model {sim_model!r} is unknown; use one of {', '.join(SIMULATED_MODELS)}")
        if sim_gpus < 1:
            raise CommandError("--sim-gpus must be at least 1")
        if problems := shared_state_problems():
            raise CommandError("; ".join(f"{setting}: {why}" for setting, why in problems))
        try:
            address, interface, how = network.choose(options["advertise_address"], options["network_interface"])
        except network.AddressError as exc:
            raise CommandError(str(exc)) from None
        agent = Agent(node, detect_provider(node, simulate, sim_model, sim_gpus), settings.HANGAR_HEARTBEAT_SECONDS)
        agent.address, agent.network_interface = address, interface
        agent.isolation = sandbox.start_checks()  # bwrap, setpriv, the docker client: found once, with our PATH
        agent.job_python = sandbox.python_problem(reach.default_python())  # run as a job uid, in a sandbox
        names = [n.strip() for n in environments.split(",") if n.strip()]
        agent.refused_environments = sandbox.unrunnable_environments(names)  # not advertised: the queue says why
        registered = agent.register(accept_inventory=accept_inventory)
        kind = "simulated" if registered.simulated else "NVML"
        self.stdout.write(f"node {registered.name}: {registered.gpu_count} x {registered.gpu_model} ({kind})")
        on = f" (ranks' traffic on {interface})" if interface else ""
        self.stdout.write(f"node {registered.name}: advertises {address}{on}: {how}")
        self.stdout.flush()  # seen at once where stdout is a file (a service's log)
        if agent.isolation[1]:
            self.stderr.write(f"WARNING: isolation: {agent.isolation[0]}: {agent.isolation[1]}")
        if agent.job_python[1]:
            self.stderr.write(f"ERROR: {agent.job_python[1]}; set HANGAR_JOB_PYTHON to a Python job uids can run")
        else:
            self.stdout.write(f"node {registered.name}: a job's python is {agent.job_python[0]}")
        for name, why in agent.refused_environments.items():
            self.stderr.write(f"ERROR: environment {name} is not offered here: {why}")
        names = [n for n in names if n not in agent.refused_environments]
        if unknown := Environment.advertise(registered, names):
            self.stderr.write(f"unknown environments ignored: {', '.join(unknown)} (define them in the admin)")
        stop = threading.Event()
        threading.Thread(target=agent.heartbeat_forever, args=(stop,), daemon=True, name="heartbeat").start()
        worker_shutting_down.connect(lambda **kw: runner.stop_all("the node's agent shut down"), weak=False)
        app.worker_main(
            [
                "--quiet",
                "worker",
                "--queues",
                taken_without_ack(registered.queue),
                "--pool",
                "threads",
                # Each attempt holds a thread while it runs; two spare ones keep
                # short tasks from waiting behind a full node.
                "--concurrency",
                str(registered.gpu_count + 2),
                "--hostname",
                f"{registered.name}@%h",
                "--prefetch-multiplier",
                "1",
                "--without-gossip",
                "--without-mingle",
                "--without-heartbeat",
                "--loglevel",
                "WARNING",
            ]
        )
        stop.set()
