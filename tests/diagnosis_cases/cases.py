"""The captured cases (made by capture.py) as the diagnosis gets them: lines, an ending, each
rank's exit and the job's files a `<string>` frame may name; and precision per category.

    python -m tests.diagnosis_cases.cases      # prints the precision table
"""

import json
from collections import Counter
from pathlib import Path

from jobs.diagnosis import Diagnosis, Ending, Line, RankExit, diagnose, wanted_files

HERE = Path(__file__).resolve().parent
ATTEMPT = 7


def names() -> list[str]:
    return sorted(p.stem for p in HERE.glob("*.json"))


def load(name: str) -> dict:
    return json.loads((HERE / f"{name}.json").read_text())


def lines_of(case: dict) -> list[Line]:
    return [Line(x["seq"], x["text"], x["rank"], f"node-{x['rank']}", x["stream"], ATTEMPT) for x in case["lines"]]


def exits_of(case: dict) -> dict[int, RankExit]:
    return {int(rank): RankExit(e["code"], e["t"], e["stopped"]) for rank, e in case["exits"].items()}


def ending_of(case: dict, exits: dict[int, RankExit]) -> Ending:
    """As the agent records it today: the exit status of the rank that ended the attempt (the
    first to fail), the failure class, the command."""
    failed = sorted((e.at, e.code) for e in exits.values() if e.code)
    return Ending(
        exit_code=failed[0][1] if failed else 0,
        failure_class=case.get("failure_class", "user"),
        world_size=case["world_size"],
        command=tuple(case.get("command", ())),
    )


def files_of(case: dict, lines: list[Line]) -> dict[str, str]:
    """What jobs/diagnosing.py would read from the job's code: only the files `wanted_files` names."""
    wanted = wanted_files(lines, tuple(case.get("command", ())))
    return {name: text for name, text in case.get("files", {}).items() if name in wanted}


def diagnosed(name: str, with_exits: bool = True) -> tuple[dict, Diagnosis]:
    case = load(name)
    lines, exits = lines_of(case), exits_of(case)
    found = diagnose(lines, ending_of(case, exits), exits=exits if with_exits else None, files=files_of(case, lines))
    return case, found


def precision() -> dict[str, tuple[int, int, int]]:
    """Per category: (diagnosed as it and right, diagnosed as it, expected to be it)."""
    said, right, expected = Counter(), Counter(), Counter()
    for name in names():
        case, found = diagnosed(name)
        want = case["expect"]["category"]
        said[found.category] += 1
        expected[want] += 1
        right[found.category] += found.category == want
    return {c: (right[c], said[c], expected[c]) for c in sorted(set(said) | set(expected))}


def table() -> str:
    rows = ["| category | cases | diagnosed as it | right | precision | recall |", "|---|---|---|---|---|---|"]
    for category, (ok, said, want) in precision().items():
        p = f"{ok / said:.2f}" if said else "-"
        r = f"{ok / want:.2f}" if want else "-"
        rows.append(f"| {category} | {want} | {said} | {ok} | {p} | {r} |")
    return "\n".join(rows)


if __name__ == "__main__":
    print(table())
    print(f"{len(names())} cases")
