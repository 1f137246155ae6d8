"""The autoresearch loop without an LLM: a hill-climb over train.py's constants, run
through the `hangar` CLI and its JSON alone.

Each round writes 4 variants of the best train.py so far (LEARNING_RATE and WIDTH moved
up and down, by steps that shrink each round), each in a directory of its own, submits
each with `hangar submit --code DIR` and an objective (`val_loss`, min) read from the log,
waits for all of them with `hangar wait ... --json` (one result document a line), reads
each one's `objective.value`, and keeps the best file as the next round's parent.

    python driver.py [--rounds 3] [--budget 20] [--workdir DIR] [-p PROJECT]
                     [--python python3] [--hangar hangar]

It needs `hangar login` (or HANGAR_URL and HANGAR_TOKEN). It writes DIR/runs.json (every
run: its round, variant, constants, file hash, job and objective) and DIR/best_train.py,
and its last line is `best_job=.. best_objective=.. learning_rate=.. width=.. runs=..`.
"""

import argparse
import hashlib
import json
import re
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
OBJECTIVE = {"metric": "val_loss", "mode": "min"}
METRICS_FROM_LOG = r"step (?P<step>\d+) (?P<name>val_loss): (?P<value>[-+0-9.eE]+)"
CONSTANTS = {"LEARNING_RATE": float, "WIDTH": int}


class HangarFailed(RuntimeError):
    pass


# --- editing train.py ------------------------------------------------------------------


def constants_of(text: str) -> dict:
    """{'LEARNING_RATE': 0.01, 'WIDTH': 32} as the file sets them."""
    found = {}
    for name, kind in CONSTANTS.items():
        match = re.search(rf"^{name} = (\S+)$", text, re.MULTILINE)
        if match is None:
            raise ValueError(f"train.py has no line `{name} = ...`")
        found[name] = kind(match.group(1))
    return found


def with_constants(text: str, values: dict) -> str:
    for name, value in values.items():
        written = f"{value:.3g}" if isinstance(value, float) else str(value)
        text, count = re.subn(rf"^{name} = \S+$", f"{name} = {written}", text, count=1, flags=re.MULTILINE)
        assert count == 1, name
    return text


def proposals(parent: dict, round_number: int) -> list[dict]:
    """Four neighbours of the parent: the learning rate and the width each moved up and down,
    by a factor that shrinks each round (3, 1.7, 1.4, ...)."""
    factor = 3 ** (1 / round_number)
    lr, width = parent["LEARNING_RATE"], parent["WIDTH"]
    return [
        {"LEARNING_RATE": float(f"{lr * factor:.3g}"), "WIDTH": width},
        {"LEARNING_RATE": float(f"{lr / factor:.3g}"), "WIDTH": width},
        {"LEARNING_RATE": lr, "WIDTH": max(int(round(width * factor)), width + 1)},
        {"LEARNING_RATE": lr, "WIDTH": max(min(int(round(width / factor)), width - 1), 2)},
    ]


# --- the hangar CLI ------------------------------------------------------------------


def hangar(args, *words: str) -> subprocess.CompletedProcess:
    return subprocess.run([*shlex.split(args.hangar), *words], capture_output=True, text=True)


def submit(args, directory: Path, name: str, key: str) -> dict:
    """`hangar submit --code DIR` with the objective in a job file; the job's JSON."""
    job_file = directory.parent / f"{directory.name}.json"
    job_file.write_text(json.dumps({"objective": OBJECTIVE, "metrics_from_log": METRICS_FROM_LOG}))
    words = ["submit", "--json", "-f", str(job_file), "--code", str(directory), "-n", name]
    words += ["--idempotency-key", key, "--max-runtime", str(args.max_runtime or int(args.budget * 3 + 60))]
    words += ["-p", args.project] if args.project else []
    words += ["--environment", args.environment] if args.environment else []
    done = hangar(args, *words, "--", args.python, "train.py", f"{args.budget:g}")
    if done.returncode != 0:  # 2 bad usage, 5 refused (a 429: a token limit), 6 unreachable
        raise HangarFailed(f"hangar submit exited {done.returncode}: {done.stderr.strip()}")
    return json.loads(done.stdout)


def wait(args, job_ids: list[int]) -> list[dict]:
    """`hangar wait ... --json`: one result document a line, in the order given. Exit 0 (all
    succeeded) or 1/3/4 (one did not) both bring every document; 124 means time ran out."""
    timeout = args.max_runtime or int(args.budget * 3 + 60)
    done = hangar(args, "wait", *map(str, job_ids), "--json", "--timeout", str(timeout * 2))
    if done.returncode not in (0, 1, 3, 4, 124):
        raise HangarFailed(f"hangar wait exited {done.returncode}: {done.stderr.strip()}")
    if done.returncode == 124:
        print(f"  {done.stderr.strip()}: scoring only the runs that ended", file=sys.stderr)
    return [json.loads(line) for line in done.stdout.splitlines() if line.strip()]


def score(doc: dict) -> float | None:
    """The run's objective value, or None when it did not succeed or never logged one."""
    objective = doc.get("objective") or {}
    if doc["state"] != "succeeded" or not objective.get("found"):
        return None
    return objective["value"]


# --- the loop ------------------------------------------------------------------------


def run_round(args, workdir: Path, parent_text: str, number: int, tag: str) -> list[dict]:
    runs = []
    for index, values in enumerate(proposals(constants_of(parent_text), number)):
        directory = workdir / f"round-{number}" / f"variant-{index}"
        directory.mkdir(parents=True)
        text = with_constants(parent_text, values)
        (directory / "train.py").write_text(text)
        sha = hashlib.sha256(text.encode()).hexdigest()
        job = submit(args, directory, f"autoresearch-r{number}-v{index}", f"{tag}-r{number}-v{index}-{sha[:12]}")
        runs.append({"round": number, "variant": index, "constants": values, "dir": str(directory),
                     "sha256": sha, "job": job["id"], "snapshot": job["code"]["snapshot"]})  # fmt: skip
    for run, doc in zip(runs, wait(args, [r["job"] for r in runs]), strict=True):
        run.update(state=doc["state"], objective=score(doc), exit_code=doc["exit_code"])
        if run["objective"] is None and doc["log_tail"]:
            run["log_tail"] = [line["text"] for line in doc["log_tail"][-5:]]  # why it crashed
    return runs


def report(runs: list[dict]) -> None:
    for run in runs:
        value = "-" if run["objective"] is None else f"{run['objective']:.5f}"
        print(f"  job {run['job']:>5}  {run['state']:<9} val_loss {value:<9} {run['constants']}")
        for line in run.get("log_tail", []):
            print(f"      | {line}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--budget", type=float, default=20.0, help="training seconds per run")
    parser.add_argument("--max-runtime", type=int, help="hard limit per run (default: 3 x budget + 60 s)")
    parser.add_argument("--workdir", help="where the variants are written (default: a new temporary directory)")
    parser.add_argument("-p", "--project")
    parser.add_argument("--python", default="python3", help="the interpreter on the node (with torch)")
    parser.add_argument("--environment", help="the job's named environment, if the node needs one")
    parser.add_argument("--hangar", default="hangar", help="how to run the CLI, e.g. 'python -m hangar.cli'")
    args = parser.parse_args()
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="autoresearch-"))
    workdir.mkdir(parents=True, exist_ok=True)
    tag = f"autoresearch-{int(time.time())}"  # idempotency keys: one set per loop
    parent_text, best, every = (HERE / "train.py").read_text(), None, []
    try:
        for number in range(1, args.rounds + 1):
            print(f"round {number}: parent {constants_of(parent_text)}", flush=True)
            runs = run_round(args, workdir, parent_text, number, tag)
            every += runs
            report(runs)
            scored = [r for r in runs if r["objective"] is not None]
            if scored and (best is None or min(r["objective"] for r in scored) < best["objective"]):
                best = min(scored, key=lambda r: r["objective"])
                parent_text = (Path(best["dir"]) / "train.py").read_text()
    except HangarFailed as exc:
        print(f"driver: {exc}", file=sys.stderr)
        return 1
    finally:
        (workdir / "runs.json").write_text(json.dumps({"runs": every, "best": best}, indent=2))
    if best is None:
        print("no run logged val_loss", file=sys.stderr)
        return 1
    (workdir / "best_train.py").write_text(parent_text)
    print(f"best: job {best['job']} (round {best['round']}, variant {best['variant']}), "
          f"val_loss {best['objective']:.5f}; its train.py is {workdir / 'best_train.py'}")  # fmt: skip
    constants = best["constants"]
    print(f"best_job={best['job']} best_objective={best['objective']:.6f} "
          f"learning_rate={constants['LEARNING_RATE']:g} width={constants['WIDTH']} runs={len(every)}")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
