"""The agents' loop as docs/agents.md teaches it: `hangar skill` prints the skill file and
names only commands the CLI has; the autoresearch example (examples/autoresearch) runs 3
rounds of 4 variants through the real `hangar` CLI process on a live stack, each run on
its own variant's code, and its best run is the one the result documents say."""

import hashlib
import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from hangar import cli
from hangar.snapshots import pack
from tests.livestack import BASE_DIR, LiveStack

PY = sys.executable
EXAMPLE = BASE_DIR / "examples" / "autoresearch"
SKILL = BASE_DIR / "hangar" / "skill.md"


def driver_module():
    spec = importlib.util.spec_from_file_location("autoresearch_driver", EXAMPLE / "driver.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def hangar_process(*args: str, env: dict | None = None, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run(
        [PY, "-m", "hangar.cli", *args], cwd=BASE_DIR, env=env, capture_output=True, text=True, timeout=timeout
    )


def parser_commands() -> dict[str, set[str]]:
    """{command: its sub-commands or choices} of the CLI's parser."""
    top = cli.parser()
    (sub,) = [a for a in top._actions if a.dest == "command_name"]
    found = {}
    for name, command in sub.choices.items():
        nested = [a for a in command._actions if a.dest in ("pipeline_command", "action")]
        found[name] = set(nested[0].choices) if nested and nested[0].choices else set()
    return found


def test_hangar_skill_prints_the_skill_file():
    done = hangar_process("skill", env={"PATH": os.environ.get("PATH", ""), "HOME": "/nonexistent"})
    assert done.returncode == 0, done.stderr
    assert done.stdout == SKILL.read_text()  # no server, no login: it is in the package
    assert "hangar wait" in done.stdout and "124" in done.stdout and "objective" in done.stdout


@pytest.mark.parametrize("doc", [SKILL, BASE_DIR / "docs" / "agents.md"])
def test_every_command_the_docs_name_exists_in_the_parser(doc):
    commands = parser_commands()
    named = re.findall(r"\bhangar ([a-z][a-z-]*)(?: ([a-z]+))?", doc.read_text())
    assert len(named) > 10, "the file names the commands it teaches"
    for command, word in named:
        assert command in commands, f"{doc.name} names `hangar {command}`, which the CLI does not have"
        if commands[command] and word:  # `hangar sweep best`, `hangar pipeline run`: the sub-command too
            assert word in commands[command], f"{doc.name} names `hangar {command} {word}`, which it does not have"


def test_every_exit_code_the_docs_list_is_one_the_cli_uses():
    listed = set(map(int, re.findall(r"^\| `(\d+)` \|", (BASE_DIR / "docs" / "agents.md").read_text(), re.M)))
    used = {cli.EXIT_OK, cli.EXIT_JOB_FAILED, cli.EXIT_USAGE, cli.EXIT_CANCELLED, cli.EXIT_INFRA}
    used |= {cli.EXIT_API, cli.EXIT_UNREACHABLE, cli.EXIT_WAIT_TIMEOUT, 130}
    assert listed == used


def test_the_driver_edits_only_its_constants_and_proposes_four_distinct_neighbours():
    driver = driver_module()
    text = (EXAMPLE / "train.py").read_text()
    parent = driver.constants_of(text)
    for number in (1, 2, 3):
        proposed = driver.proposals(parent, number)
        assert len({json.dumps(p, sort_keys=True) for p in proposed} | {json.dumps(parent, sort_keys=True)}) == 5
        edited = driver.with_constants(text, proposed[0])
        assert driver.constants_of(edited) == proposed[0]
        changed = [(a, b) for a, b in zip(text.splitlines(), edited.splitlines(), strict=True) if a != b]
        assert all(a.split(" = ")[0] in driver.CONSTANTS for a, _ in changed)


# --- the example, end to end ------------------------------------------------------------


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    env = {"HANGAR_SIM_GPUS": "4"}  # one node of 4: a round's variants run at once
    with LiveStack(env=env, data_dir=str(tmp_path_factory.mktemp("agents-stack"))) as live:
        yield live


@pytest.mark.e2e
def test_the_autoresearch_example_runs_three_rounds_on_its_own_code(stack, tmp_path):
    env = {**os.environ, "HANGAR_URL": stack.url, "HANGAR_TOKEN": stack.token, "HANGAR_CONFIG": str(tmp_path / "c")}
    workdir = tmp_path / "loop"
    driver = [PY, str(EXAMPLE / "driver.py"), "--rounds", "3", "--budget", "2", "--workdir", str(workdir)]
    driver += ["-p", "default", "--python", PY, "--hangar", f"{PY} -m hangar.cli"]
    done = subprocess.run(driver, cwd=BASE_DIR, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr + stack.output()[-3000:]
    print(done.stdout)  # the rounds, as the driver reports them (pytest -s shows them)
    record = json.loads((workdir / "runs.json").read_text())
    runs = record["runs"]
    assert [(r["round"], r["variant"]) for r in runs] == [(n, v) for n in (1, 2, 3) for v in range(4)]
    assert all(r["state"] == "succeeded" and r["objective"] is not None for r in runs), runs

    for number in (1, 2, 3):
        this_round = [r for r in runs if r["round"] == number]
        assert len({r["snapshot"] for r in this_round}) == 4 and len({r["sha256"] for r in this_round}) == 4
    for run in runs:
        own = hashlib.sha256((Path(run["dir"]) / "train.py").read_bytes()).hexdigest()
        assert run["sha256"] == own and run["snapshot"] == pack(run["dir"]).sha256
        logs = hangar_process("logs", str(run["job"]), "--json", env=env)
        printed = [json.loads(line)["text"] for line in logs.stdout.splitlines()]
        first = next(text for text in printed if not text.startswith("[hangar]"))  # after the agent's own line
        assert first == f"code sha256: {own}", (run, first)  # the job ran its own variant's file

    # Each round's variants are the neighbours of the best run so far (the first: of train.py).
    parent = driver_module().constants_of((EXAMPLE / "train.py").read_text())
    for number in (1, 2, 3):
        this_round = [r for r in runs if r["round"] == number]
        assert [r["constants"] for r in this_round] == driver_module().proposals(parent, number)
        so_far = [r for r in runs if r["round"] <= number]
        parent = min(so_far, key=lambda r: r["objective"])["constants"]

    # The best run, from the result documents alone, is the one the driver kept.
    results = [json.loads(hangar_process("result", str(r["job"]), "--json", env=env).stdout) for r in runs]
    assert all(doc["objective"]["found"] and doc["metrics"]["val_loss"]["points"] >= 1 for doc in results)
    best = min(results, key=lambda doc: doc["objective"]["value"])
    assert record["best"]["job"] == best["id"] and record["best"]["objective"] == best["objective"]["value"]
    last = done.stdout.strip().splitlines()[-1]
    assert last.startswith(f"best_job={best['id']} ") and "runs=12" in last
    assert (workdir / "best_train.py").read_text() == (Path(record["best"]["dir"]) / "train.py").read_text()
