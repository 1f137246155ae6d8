"""Code snapshots: packing DIR (ignore rules, symlinks, the size limit), the server's checks
of an upload (hash, members that would land outside, devices, size, a header bomb through the
API), submitting, resubmitting and downloading a job's code, retention, and the agent's fresh
copy per rank and attempt (a stored bomb fails its attempt as the user's error, at once)."""

import hashlib
import io
import os
import resource
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from datetime import timedelta
from pathlib import Path

import pytest
from django.utils import timezone

from agent import runner as execution
from agent import running
from agent import snapshots as node_snapshots
from fleet.models import GPU
from hangar.snapshots import SnapshotError, pack, unpack
from jobs import scheduler, snapshots
from jobs.models import Job, JobState, LogLine, Snapshot, SnapshotChunk
from portal.models import Role
from tests.factories import api_client, make_job, make_node, make_snapshot, make_user
from tests.test_snapshots_tarballs import header_bomb


def peak_rss_mb() -> float:
    """This process's peak resident memory so far (ru_maxrss is in KiB on Linux)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def write(root: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    return root


def names_in(data: bytes) -> dict[str, str]:
    """Each member's path, and its link target or 'file'."""
    with tarfile.open(fileobj=io.BytesIO(data), mode="r:gz") as tar:
        return {m.name: (m.linkname if m.issym() else "file") for m in tar.getmembers()}


def git(root: Path, *args: str) -> str:
    env = {**os.environ, "GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@x", "GIT_COMMITTER_NAME": "t"}
    env["GIT_COMMITTER_EMAIL"] = "t@x"
    return subprocess.run(["git", "-C", str(root), *args], check=True, capture_output=True, text=True, env=env).stdout


# --- packing (the client, no Django) ------------------------------------------------


def test_a_directory_outside_git_honours_nested_gitignores_and_hangarignore(tmp_path):
    write(
        tmp_path,
        {
            "train.py": "print(1)",
            ".gitignore": "*.log\nbuild/\n",
            "build/out.bin": "x",
            "run.log": "x",
            "sub/.gitignore": "*.tmp\n!keep.log\n",
            "sub/a.tmp": "x",
            "sub/keep.log": "kept: the deeper .gitignore re-includes it",
            "sub/b.py": "x",
            ".hangarignore": "data/\n",
            "data/big.csv": "x",
            ".git/config": "not a repository, but never packed",
        },
    )
    assert set(names_in(pack(tmp_path).data)) == {
        "train.py",
        ".gitignore",
        ".hangarignore",
        "sub/.gitignore",
        "sub/keep.log",
        "sub/b.py",
    }


def test_a_git_work_tree_packs_what_git_would_commit_and_records_commit_branch_and_diff(tmp_path):
    git(tmp_path, "init", "-q", "-b", "exp")
    write(tmp_path, {"train.py": "lr = 1\n", ".gitignore": "ckpt/\n", "ckpt/w.pt": "x", "tracked_big.bin": "x"})
    git(tmp_path, "add", ".")
    git(tmp_path, "commit", "-qm", "first")
    commit = git(tmp_path, "rev-parse", "HEAD").strip()
    clean = pack(tmp_path)
    assert clean.git == {"commit": commit, "branch": "exp", "dirty": False, "diff": "", "diff_truncated": False}

    write(tmp_path, {"train.py": "lr = 2\n", "new.py": "untracked, not ignored", ".hangarignore": "*.bin\n"})
    dirty = pack(tmp_path)
    assert set(names_in(dirty.data)) == {"train.py", ".gitignore", "new.py", ".hangarignore"}
    assert dirty.git["dirty"] is True and dirty.git["commit"] == commit
    assert "-lr = 1\n+lr = 2" in dirty.git["diff"]
    assert dirty.sha256 != clean.sha256


def test_an_unchanged_tree_packs_to_the_same_hash_whatever_its_times(tmp_path):
    write(tmp_path, {"a.py": "a", "b/c.py": "c"})
    first = pack(tmp_path)
    os.utime(tmp_path / "a.py", (0, 0))
    assert pack(tmp_path).sha256 == first.sha256
    (tmp_path / "a.py").write_text("changed")
    assert pack(tmp_path).sha256 != first.sha256


def test_a_symlink_inside_is_packed_as_a_link_and_one_outside_is_refused(tmp_path):
    root = write(tmp_path / "code", {"lib/util.py": "x", "train.py": "x"})
    (root / "util.py").symlink_to("lib/util.py")
    (root / "lib_alias").symlink_to(root / "lib")  # absolute, but inside: packed relative, never walked into
    assert names_in(pack(root).data)["util.py"] == "lib/util.py"
    assert names_in(pack(root).data)["lib_alias"] == "lib"
    assert "lib_alias/util.py" not in names_in(pack(root).data)

    (root / "loop").symlink_to("loop")  # left out, said so
    (root / "later").symlink_to("out/model.pt")  # dangling, inside: kept
    packed = pack(root)
    assert packed.skipped == ["loop (a symlink loop)"] and names_in(packed.data)["later"] == "out/model.pt"

    write(tmp_path, {"secret.txt": "outside"})
    (root / "data").symlink_to(tmp_path / "secret.txt")
    with pytest.raises(SnapshotError) as refused:
        pack(root)
    assert f"data -> {tmp_path / 'secret.txt'}" in str(refused.value)
    assert "Add them to .hangarignore" in str(refused.value)

    write(root, {".hangarignore": "data\n"})
    assert "data" not in names_in(pack(root).data)


def test_over_the_limit_names_the_limit_and_the_biggest_files(tmp_path):
    write(tmp_path, {"small.py": "x"})
    (tmp_path / "weights.bin").write_bytes(b"\0" * 700_000)
    (tmp_path / "data.npy").write_bytes(b"\0" * 400_000)
    with pytest.raises(SnapshotError) as refused:
        pack(tmp_path, limit_mb=1)
    message = str(refused.value)
    assert "over the 1 MB limit" in message
    assert message.index("weights.bin (0.7 MB)") < message.index("data.npy (0.4 MB)")
    assert "--code-limit" in message and ".hangarignore" in message
    assert pack(tmp_path, limit_mb=2).files == 3


# --- the server's checks --------------------------------------------------------------


def evil(*members: tarfile.TarInfo, payload: bytes = b"x") -> bytes:
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w:gz") as tar:
        for member in members:
            tar.addfile(member, io.BytesIO(payload) if member.isreg() else None)
    return out.getvalue()


def member(name: str, kind=tarfile.REGTYPE, link: str = "", size: int = 1) -> tarfile.TarInfo:
    info = tarfile.TarInfo(name)
    info.type, info.linkname, info.size = kind, link, size if kind == tarfile.REGTYPE else 0
    return info


@pytest.mark.parametrize(
    "members, problem",
    [
        ([member("/etc/cron.d/x")], "has an absolute path"),
        ([member("a/../../x")], "outside its directory (..)"),
        ([member("up", tarfile.SYMTYPE, "../../etc")], "outside the snapshot's directory"),
        ([member("abs", tarfile.SYMTYPE, "/etc/passwd")], "outside the snapshot's directory"),
        # each harmless alone: q is the directory itself, k goes one above it
        ([member("q", tarfile.SYMTYPE, "."), member("k", tarfile.SYMTYPE, "q/..")], "'k' is a symlink to 'q/..'"),
        ([member("loop", tarfile.SYMTYPE, "loop/x")], "outside the snapshot's directory"),
        ([member("d", tarfile.SYMTYPE, "sub"), member("d/x")], "lies under the symlink 'd'"),
        ([member("hard", tarfile.LNKTYPE, "train.py")], "is a hard link"),
        ([member("tty", tarfile.CHRTYPE)], "is a device, fifo or other special file"),
        ([member("fifo", tarfile.FIFOTYPE)], "is a device, fifo or other special file"),
    ],
)
def test_the_server_refuses_members_that_would_unpack_outside_or_are_not_files(members, problem):
    with pytest.raises(snapshots.SnapshotRefused) as refused:
        snapshots.check_tarball(io.BytesIO(evil(*members)), 10**6, 100)
    assert problem in refused.value.message and refused.value.field == "body"


def test_links_inside_and_plain_trees_pass_the_checks():
    ok = evil(member("lib/u.py"), member("u.py", tarfile.SYMTYPE, "lib/u.py"), member("lib/up", tarfile.SYMTYPE, ".."))
    assert snapshots.check_tarball(io.BytesIO(ok), 10**6, 100).files == 3


def test_the_server_refuses_a_tarball_past_the_size_or_file_limit():
    with pytest.raises(snapshots.SnapshotRefused, match="unpack to more than"):
        snapshots.check_tarball(io.BytesIO(evil(member("big", size=2000), payload=b"x" * 2000)), 1000, 100)
    with pytest.raises(snapshots.SnapshotRefused, match="more than 2 files"):
        snapshots.check_tarball(io.BytesIO(evil(member("a"), member("b"), member("c"))), 10**6, 2)


# --- the API ------------------------------------------------------------------------------


def put(client, slug: str, data: bytes, sha: str | None = None):
    sha = sha or hashlib.sha256(data).hexdigest()
    return client.put(f"/api/v1/projects/{slug}/snapshots/{sha}/", data, content_type="application/gzip")


@pytest.fixture
def code(tmp_path) -> bytes:
    return pack(write(tmp_path / "code", {"train.py": "print('hi')"})).data


def test_upload_once_then_the_project_has_it(project, teammate, code):
    client = api_client(teammate)
    sha = hashlib.sha256(code).hexdigest()
    assert client.get(f"/api/v1/projects/vision/snapshots/{sha}/").status_code == 404
    created = put(client, "vision", code)
    assert created.status_code == 201, created.json()
    assert created.json() | {"created_at": 0, "last_referenced_at": 0} == {
        "project": "vision",
        "sha256": sha,
        "size": len(code),
        "unpacked_size": len("print('hi')"),
        "files": 1,
        "created_at": 0,
        "last_referenced_at": 0,
    }
    assert put(client, "vision", code).status_code == 200
    assert client.get(f"/api/v1/projects/vision/snapshots/{sha}/").json()["sha256"] == sha
    assert SnapshotChunk.objects.filter(snapshot__sha256=sha).count() == 1


def test_a_refused_upload_names_the_problem_and_stores_nothing(project, teammate, code, settings):
    client = api_client(teammate)
    wrong = put(client, "vision", code, sha="0" * 64)
    assert wrong.status_code == 400
    assert wrong.json()["errors"][0]["field"] == "sha256"
    assert "name the hash of what you send" in wrong.json()["message"]

    escaping = put(client, "vision", evil(member("../../root/.ssh/authorized_keys")))
    assert escaping.status_code == 400
    assert escaping.json()["message"].startswith("body: member '../../root/.ssh/authorized_keys' would unpack outside")

    assert put(client, "vision", b"not a tarball").json()["message"].startswith("body: is not a readable tar.gz")
    not_sha = client.put("/api/v1/projects/vision/snapshots/abc/", code, content_type="application/gzip")
    assert not_sha.status_code == 400 and "64 lowercase hex digits" in not_sha.json()["message"]

    settings.HANGAR_SNAPSHOT_MAX_MB = 1
    big = evil(member("w.bin", size=3 * 1024 * 1024), payload=os.urandom(3 * 1024 * 1024))
    too_big = put(client, "vision", big)
    assert too_big.status_code == 413 and "at most" in too_big.json()["message"]
    assert not Snapshot.objects.exists() and not SnapshotChunk.objects.exists()


def test_viewers_may_not_upload_and_outsiders_see_nothing(project, outsider, code):
    viewer = make_user("viewer")
    project.memberships.create(user=viewer, role=Role.VIEWER)
    assert put(api_client(viewer), "vision", code).status_code == 403
    assert put(api_client(outsider), "vision", code).status_code == 404
    sha = hashlib.sha256(code).hexdigest()
    put(api_client(project.memberships.get(role=Role.MEMBER).user), "vision", code)
    assert api_client(outsider).get(f"/api/v1/projects/vision/snapshots/{sha}/").status_code == 404
    assert api_client(viewer).get(f"/api/v1/projects/vision/snapshots/{sha}/").status_code == 200


def submit(client, **fields):
    spec = {"project": "vision", "command": ["python", "train.py"], **fields}
    return client.post("/api/v1/jobs/", spec, format="json")


def test_a_job_records_its_snapshot_and_git_facts_and_resubmit_reuses_them(project, teammate, node, tmp_path):
    snapshot = make_snapshot(project, teammate, {"train.py": "print(1)"}, tmp_path)
    client = api_client(teammate)
    facts = {"snapshot": snapshot.sha256, "commit": "a" * 40, "branch": "exp", "dirty": True, "diff": "-a\n+b\n"}
    response = submit(client, code=facts)
    assert response.status_code == 201, response.json()
    job = response.json()
    assert job["code"]["snapshot"] == snapshot.sha256 and job["code"]["available"] is True
    assert job["code"]["branch"] == "exp" and job["code"]["dirty"] is True and job["code"]["files"] == 1
    assert job["code_version"] == "a" * 40 + "+dirty"
    assert client.get(f"/api/v1/jobs/{job['id']}/code/diff/").content == b"-a\n+b\n"

    again = client.post(f"/api/v1/jobs/{job['id']}/resubmit/").json()
    stored = Job.objects.get(pk=again["id"])
    assert stored.snapshot_id == snapshot.pk and stored.code["commit"] == "a" * 40 and stored.code_diff == "-a\n+b\n"

    download = client.get(f"/api/v1/jobs/{again['id']}/code/")
    body = b"".join(download.streaming_content)
    assert download["Content-Type"] == "application/gzip" and hashlib.sha256(body).hexdigest() == snapshot.sha256


def test_run_again_from_the_page_reuses_the_snapshot(project, teammate, node, tmp_path, client):
    snapshot = make_snapshot(project, teammate, {"train.py": "print(1)"}, tmp_path)
    job = Job.objects.get(pk=submit(api_client(teammate), code={"snapshot": snapshot.sha256}).json()["id"])
    client.force_login(teammate)
    page = client.get(f"/jobs/{job.pk}/").content.decode()
    assert snapshot.sha256[:12] in page and f"/api/v1/jobs/{job.pk}/code/" in page
    client.post(f"/jobs/{job.pk}/run-again/")
    assert Job.objects.exclude(pk=job.pk).get().snapshot_id == snapshot.pk


def test_a_submit_naming_a_snapshot_the_project_lacks_is_refused(project, teammate, other_project, outsider, tmp_path):
    theirs = make_snapshot(other_project, outsider, {"x.py": "x"}, tmp_path)
    client = api_client(teammate)
    refused = submit(client, code={"snapshot": theirs.sha256})
    assert refused.status_code == 400
    assert refused.json()["errors"][0]["field"] == "code.snapshot"
    assert f"project vision has no snapshot {theirs.sha256}; upload it first" in refused.json()["message"]
    unknown = submit(client, code={"snapshot": theirs.sha256, "sha": "x"})
    assert unknown.json()["errors"][0] == {
        "field": "code.sha",
        "message": "is not a field of code; known fields are snapshot, commit, branch, dirty, diff, diff_truncated",
    }
    assert submit(client, code={"snapshot": "nope"}).json()["errors"][0]["field"] == "code.snapshot"
    assert not Job.objects.exists()


def test_another_projects_job_code_answers_404(project, teammate, outsider, tmp_path):
    snapshot = make_snapshot(project, teammate, {"train.py": "x"}, tmp_path)
    job = make_job(project, teammate, snapshot=snapshot, code={"snapshot": snapshot.sha256})
    for url in (f"/api/v1/jobs/{job.pk}/code/", f"/api/v1/jobs/{job.pk}/code/diff/"):
        assert api_client(outsider).get(url).status_code == 404
    plain = make_job(project, teammate)
    assert "without code" in api_client(teammate).get(f"/api/v1/jobs/{plain.pk}/code/").json()["message"]


# --- retention ------------------------------------------------------------------------------


def test_retention_deletes_snapshots_no_job_named_for_n_days_but_not_a_waiting_jobs(project, teammate, tmp_path):
    old = timezone.now() - timedelta(days=31)
    unused = make_snapshot(project, teammate, {"a.py": "1"}, tmp_path / "a")
    ended = make_snapshot(project, teammate, {"a.py": "2"}, tmp_path / "b")
    waiting = make_snapshot(project, teammate, {"a.py": "3"}, tmp_path / "c")
    recent = make_snapshot(project, teammate, {"a.py": "4"}, tmp_path / "d")
    Snapshot.objects.exclude(pk=recent.pk).update(last_referenced_at=old)
    done = make_job(project, teammate, snapshot=ended, code={"snapshot": ended.sha256}, state=JobState.SUCCEEDED)
    make_job(project, teammate, snapshot=waiting, code={"snapshot": waiting.sha256}, state=JobState.QUEUED)

    assert Snapshot.delete_expired(30) == 2
    assert set(Snapshot.objects.values_list("pk", flat=True)) == {waiting.pk, recent.pk}
    assert not SnapshotChunk.objects.filter(snapshot_id__in=[unused.pk, ended.pk]).exists()
    done.refresh_from_db()
    assert done.snapshot_id is None and done.code["snapshot"] == ended.sha256  # the job keeps the hash
    gone = api_client(teammate).get(f"/api/v1/jobs/{done.pk}/code/")
    assert gone.status_code == 410 and "HANGAR_SNAPSHOT_RETENTION_DAYS" in gone.json()["message"]


# --- the agent ------------------------------------------------------------------------------


@pytest.fixture
def node_dirs(settings, tmp_path):
    settings.HANGAR_JOB_WORKDIR = tmp_path / "jobs"
    settings.HANGAR_SNAPSHOT_CACHE_DIR = tmp_path / "cache"
    running.CURRENT = None
    yield tmp_path
    running.CURRENT = None


SCRIPT = """
import hashlib, os, pathlib, sys
print("sha", hashlib.sha256(pathlib.Path("train.py").read_bytes()).hexdigest())
print("leftover", pathlib.Path("out.txt").exists())
pathlib.Path("out.txt").write_text("written by attempt " + os.environ["HANGAR_ATTEMPT"])
sys.exit(1 if os.environ["HANGAR_ATTEMPT"] == "1" else 0)
"""


def test_each_attempt_runs_in_a_fresh_copy_of_the_snapshot(transactional_db, project, owner, node_dirs):
    GPU.objects.filter(node=make_node()).update(temperature_c=35, sampled_at=timezone.now())  # preflight passes
    snapshot = make_snapshot(project, owner, {"train.py": SCRIPT}, node_dirs / "src")
    job = make_job(
        project, owner, command=[sys.executable, "train.py"], snapshot=snapshot, code={"snapshot": snapshot.sha256}
    )
    Job.objects.filter(pk=job.pk).update(max_retries=1)
    for _ in range(2):
        (attempt,) = scheduler.schedule_pass()
        execution.run_attempt(attempt.pk)
    job.refresh_from_db()
    lines = LogLine.objects.filter(attempt__job=job).order_by("attempt__number", "seq")
    texts = list(lines.values_list("text", flat=True))
    own = hashlib.sha256(SCRIPT.encode()).hexdigest()
    assert job.state == JobState.SUCCEEDED, texts
    assert texts.count(f"sha {own}") == 2
    assert texts.count("leftover False") == 2  # attempt 2 did not see what attempt 1 wrote
    assert (node_dirs / "cache" / snapshot.sha256 / "train.py").read_text() == SCRIPT  # the cache is untouched
    assert not (node_dirs / "jobs" / str(job.pk) / "code-1-0").exists()  # a rank's copy goes when it ends
    assert (node_dirs / "jobs" / str(job.pk) / "checkpoints").is_dir()  # the checkpoints stay


def test_the_agent_refuses_a_stored_snapshot_that_does_not_match_its_hash(db, project, owner, node_dirs):
    snapshot = make_snapshot(project, owner, {"train.py": "x"}, node_dirs / "src")
    SnapshotChunk.objects.filter(snapshot=snapshot).update(data=b"damaged")
    job = make_job(project, owner, snapshot=snapshot, code={"snapshot": snapshot.sha256})
    with pytest.raises(node_snapshots.CodeRefused, match="stored chunks are damaged; submit again with --code"):
        node_snapshots.fresh_copy(job, node_dirs / "w")
    assert not (node_dirs / "cache" / snapshot.sha256).exists()
    Snapshot.objects.filter(pk=snapshot.pk).delete()
    job.refresh_from_db()
    with pytest.raises(node_snapshots.CodeUnavailable, match="no longer stored"):
        node_snapshots.fresh_copy(job, node_dirs / "w")


def stored_as_is(project, user, data: bytes) -> Snapshot:
    """A snapshot row holding `data` unchecked, as one uploaded before the checks would be."""
    snapshot = Snapshot.objects.create(
        project=project, sha256=hashlib.sha256(data).hexdigest(), size=len(data), unpacked_size=1, files=1
    )
    SnapshotChunk.objects.create(snapshot=snapshot, index=0, data=data)
    return snapshot


def run_one(project, owner, snapshot: Snapshot, command: list[str]):
    job = make_job(project, owner, command=command, snapshot=snapshot, code={"snapshot": snapshot.sha256})
    (attempt,) = scheduler.schedule_pass()
    execution.run_attempt(attempt.pk)
    attempt.refresh_from_db()
    job.refresh_from_db()
    return job, attempt


def test_a_stored_bomb_fails_its_attempt_at_once_as_the_users_error(transactional_db, project, owner, node_dirs):
    GPU.objects.filter(node=make_node()).update(temperature_c=35, sampled_at=timezone.now())
    good = make_snapshot(project, owner, {"train.py": "print('ran from the snapshot')"}, node_dirs / "src")
    job, attempt = run_one(project, owner, good, [sys.executable, "train.py"])
    assert attempt.state == "succeeded", attempt.reason  # the setup runs a snapshot's code
    assert LogLine.objects.filter(attempt=attempt, text="ran from the snapshot").exists()

    bomb = stored_as_is(project, owner, header_bomb())
    before, start = peak_rss_mb(), time.perf_counter()
    job, attempt = run_one(project, owner, bomb, [sys.executable, "train.py"])
    elapsed, grew = time.perf_counter() - start, peak_rss_mb() - before
    assert (attempt.state, attempt.failure_class, job.state) == ("failed", "user", "failed"), attempt.reason
    assert f"code snapshot {bomb.sha256[:12]} cannot be unpacked: a tar GNU long name holds 805306368" in attempt.reason
    assert "Submit again with `hangar submit --code DIR`" in attempt.reason
    assert grew < 50 and elapsed < 10, (grew, elapsed)
    assert not (node_dirs / "cache" / bomb.sha256).exists()
    assert [p.name for p in (node_dirs / "cache").iterdir()] == [good.sha256]  # no half-unpacked scratch left


def test_a_header_bomb_upload_is_refused_naming_the_body_before_it_is_inflated(project, teammate):
    bomb = header_bomb()
    client = api_client(teammate)
    before, start = peak_rss_mb(), time.perf_counter()
    refused = put(client, "vision", bomb)
    elapsed, grew = time.perf_counter() - start, peak_rss_mb() - before
    assert refused.status_code == 400, refused.json()
    assert refused.json()["errors"][0]["field"] == "body"
    assert refused.json()["message"].startswith("body: a tar GNU long name holds 805306368 bytes (768 MiB)")
    assert grew < 50 and elapsed < 2, (grew, elapsed)
    assert not Snapshot.objects.exists() and not SnapshotChunk.objects.exists()


def test_hangar_code_unpacks_what_was_packed(tmp_path):
    root = write(tmp_path / "src", {"train.py": "x", "lib/u.py": "y"})
    (root / "u.py").symlink_to("lib/u.py")
    assert unpack(pack(root).data, tmp_path / "out") == 3
    assert (tmp_path / "out" / "u.py").read_text() == "y" and (tmp_path / "out" / "u.py").is_symlink()


def test_a_snapshot_upload_may_be_larger_than_other_request_bodies(project, teammate, settings, tmp_path):
    settings.HANGAR_MAX_BODY_BYTES = 64 * 1024
    (tmp_path / "weights.bin").write_bytes(os.urandom(200 * 1024))
    data = pack(tmp_path).data
    client = api_client(teammate)
    assert put(client, "vision", data).status_code == 201
    assert client.post("/api/v1/jobs/", data, content_type="application/gzip").status_code == 413


@pytest.mark.skipif(os.getuid() != 0 or not shutil.which("bwrap"), reason="a sandbox needs root and bubblewrap")
def test_a_sandboxed_job_runs_in_its_own_copy_as_its_uid_and_sees_no_cache(transactional_db, project, owner, settings):
    settings.HANGAR_SANDBOX, settings.HANGAR_JOB_UID_RANGE = True, (200000, 299999)
    source = Path(tempfile.mkdtemp(prefix="hangar-code-"))
    snapshot = make_snapshot(project, owner, {"train.sh": "echo from-the-snapshot"}, source)
    cache = settings.HANGAR_SNAPSHOT_CACHE_DIR
    script = f"id -u; stat -c owner=%u .; sh train.sh; echo w > out.txt && echo wrote; ls {cache} || echo no-cache"
    job = make_job(
        project, owner, command=["/bin/sh", "-c", script], snapshot=snapshot, code={"snapshot": snapshot.sha256}
    )
    GPU.objects.filter(node=make_node()).update(temperature_c=35, sampled_at=timezone.now())
    (attempt,) = scheduler.schedule_pass()
    execution.run_attempt(attempt.pk)
    attempt.refresh_from_db()
    texts = list(LogLine.objects.filter(attempt=attempt).order_by("seq").values_list("text", flat=True))
    assert attempt.state == "succeeded", (attempt.reason, texts)
    # 200000 + job.pk, or the next free uid when a job of another test worker (its own database,
    # the same job ids) holds that one on this machine at the time (agent/sandbox.py: job_uid).
    (uid,) = [int(text) for text in texts if text.isdigit()]
    assert 200000 + job.pk <= uid <= 299999
    assert {f"owner={uid}", "from-the-snapshot", "wrote", "no-cache"} <= set(texts)
    assert (cache / snapshot.sha256 / "train.sh").exists() and not (cache / snapshot.sha256 / "out.txt").exists()
    shutil.rmtree(source)


def test_the_node_cache_evicts_the_least_recently_used_entries_but_not_one_in_use(tmp_path):
    now = time.time()
    for name, age in (("old", 7200), ("older", 9000), ("busy", 60), ("new", 0)):
        (tmp_path / name).mkdir()
        os.utime(tmp_path / name, (now - age, now - age))
    (tmp_path / ".unpack-x").mkdir()  # an unpacking in progress is no entry
    assert node_snapshots.evict(tmp_path, keep=1) == ["older", "old"]
    assert sorted(p.name for p in tmp_path.iterdir()) == [".unpack-x", "busy", "new"]


# --- the fresh copy and what a job can write ------------------------------------------------------

PLANT = """
import os, sys
print("uid", os.getuid(), flush=True)
if os.environ["HANGAR_ATTEMPT"] == "1":
    try:  # where attempt 2's copy will be made, a link to a directory of the job's choosing
        os.symlink(sys.argv[1], os.path.join(os.getcwd(), "..", "code-2-0"))
        print("planted code-2-0", flush=True)
    except OSError as exc:
        print("refused code-2-0", exc.strerror, flush=True)
    open("mine.txt", "w").write("attempt 1")
    sys.exit(1)
print("attempt 2 sees", sorted(os.listdir(".")), flush=True)
"""
SYSTEM_PYTHON = shutil.which("python3", path="/usr/bin:/bin")


@pytest.mark.skipif(os.getuid() != 0 or not shutil.which("bwrap"), reason="job uids need the agent to run as root")
@pytest.mark.skipif(SYSTEM_PYTHON is None, reason="needs a python3 that job uids can run")
@pytest.mark.parametrize("sandbox", [True, False])
def test_a_job_cannot_plant_a_link_where_the_next_attempts_copy_goes(
    transactional_db, project, owner, settings, sandbox
):
    """Root copies each attempt's code into the job's directory: the job (its own uid, with or
    without bubblewrap) tries to put a symlink to another directory where attempt 2's copy
    will be made; the directory is root's, so it cannot, and attempt 2 gets a fresh copy."""
    public = Path(tempfile.mkdtemp(prefix="hangar-snapshot-"))
    public.chmod(0o755)  # job uids can reach it (pytest's tmp_path is root's alone)
    try:
        settings.HANGAR_JOB_WORKDIR, settings.HANGAR_SNAPSHOT_CACHE_DIR = public / "jobs", public / "cache"
        settings.HANGAR_SANDBOX, settings.HANGAR_JOB_UID_RANGE = sandbox, (200000, 299999)
        victim = public / "victim"
        victim.mkdir(mode=0o777)  # a directory the job could write itself, so a link to it is its to make
        running.CURRENT = None
        GPU.objects.filter(node=make_node()).update(temperature_c=35, sampled_at=timezone.now())
        snapshot = make_snapshot(project, owner, {"train.py": PLANT}, public / "src")
        command = [SYSTEM_PYTHON, "train.py", str(victim)]
        job = make_job(project, owner, command=command, snapshot=snapshot, code={"snapshot": snapshot.sha256})
        Job.objects.filter(pk=job.pk).update(max_retries=1)
        jobdir = public / "jobs" / str(job.pk)
        for number in (1, 2):
            (attempt,) = scheduler.schedule_pass()
            execution.run_attempt(attempt.pk)
            if number == 1:  # in a sandbox the link lands in its own view of the parent, never on the host
                assert not (jobdir / "code-2-0").exists() and not (jobdir / "code-2-0").is_symlink()
        job.refresh_from_db()
        lines = LogLine.objects.filter(attempt__job=job).order_by("attempt__number", "seq")
        texts = list(lines.values_list("text", flat=True))
        assert any(t.startswith("uid 2") for t in texts), texts  # the setup: it ran as a job uid
        assert sandbox or "refused code-2-0 Permission denied" in texts, texts
        assert job.state == JobState.SUCCEEDED, texts
        assert "attempt 2 sees ['train.py']" in texts  # a fresh copy: nothing attempt 1 wrote
        assert list(victim.iterdir()) == []
        assert (jobdir.stat().st_uid, jobdir.stat().st_mode & 0o777) == (0, 0o711)
    finally:
        running.CURRENT = None
        shutil.rmtree(public, ignore_errors=True)
