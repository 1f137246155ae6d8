"""Rules on what a job spec may ask for, as plain functions over plain data: the submit
path (jobs/api/serializers.py, later jobs/submission.py) calls them and says what they say.

- Reserved variable names: the ones Hangar sets for each attempt, and the ones that would
  change what the agent's own programs (the docker client, the sandbox) load or talk to.
- Secrets on a resubmit or run-again by another user: their values never travel with the
  copy; the names are required again.
"""

import fnmatch
import re

from packaging.requirements import InvalidRequirement, Requirement
from packaging.specifiers import SpecifierSet
from packaging.utils import canonicalize_name
from packaging.version import InvalidVersion, Version

RESERVED_NAMES = {
    "CUDA_VISIBLE_DEVICES": "is set by Hangar for each attempt (the GPUs placed for it)",
    "NVIDIA_VISIBLE_DEVICES": "would choose the GPUs a container sees; Hangar gives each job the GPUs placed for it",
    "LD_PRELOAD": "would load a library into every program started for the job, the agent's included",
    "LD_LIBRARY_PATH": "would change the libraries of every program started for the job, the agent's included; "
    "use an environment (its path) or set it inside your command",
}
# What glibc ignores in set-uid programs (its unsecvars.h), less TMPDIR: read by every program
# the agent starts as root for a job before it takes the job's uid (prlimit, setpriv, env,
# bwrap get the job's environment), they would load a library into it (LD_AUDIT, GCONV_PATH),
# retune its allocator (GLIBC_TUNABLES), or write a file it names (MALLOC_TRACE, LD_DEBUG_OUTPUT).
ROOT_UNSAFE = {
    "GCONV_PATH", "GETCONF_DIR", "GLIBC_TUNABLES", "HOSTALIASES", "LD_AUDIT", "LD_DEBUG", "LD_DEBUG_OUTPUT",
    "LD_DYNAMIC_WEAK", "LD_HWCAP_MASK", "LD_LIBRARY_PATH", "LD_ORIGIN_PATH", "LD_PRELOAD", "LD_PROFILE",
    "LD_SHOW_AUXV", "LD_USE_LOAD_BIAS", "LOCALDOMAIN", "LOCPATH", "MALLOC_TRACE", "NIS_PATH", "NLSPATH",
    "RESOLV_HOST_CONF", "RES_OPTIONS", "TZDIR",
}  # fmt: skip
ROOT_UNSAFE_REASON = (
    "is read by the programs the agent starts as root before the job's own uid (glibc honours it outside "
    "set-uid programs); set it inside your command"
)
RESERVED_PREFIXES = {
    "HANGAR_": "is set by Hangar for each attempt (names starting with HANGAR_ are Hangar's)",
    "MLFLOW_": "is set by Hangar for each attempt: a job logs to its own MLflow run (names starting with MLFLOW_ "
    "are Hangar's)",
    "DOCKER_": "would change which docker engine or configuration the agent's docker client uses",
}
CONTAINER_RESERVED = {
    "PATH": "would choose the programs the agent runs for a container job; set PATH in the image instead",
}


def reserved_reason(name: str, container: bool = False) -> str | None:
    """Why `name` may not be set by a job (None: it may)."""
    if name in RESERVED_NAMES:
        return RESERVED_NAMES[name]
    if name in ROOT_UNSAFE:
        return ROOT_UNSAFE_REASON
    for prefix, why in RESERVED_PREFIXES.items():
        if name.startswith(prefix):
            return why
    if container:
        return CONTAINER_RESERVED.get(name)
    return None


def env_problem(names, container: bool = False) -> str | None:
    """The first reserved name among `names`, said as the submit answers it."""
    for name in names:
        if why := reserved_reason(name, container):
            return f"{name} {why}; remove it from env"
    return None


def secrets_to_give(secret_names, submitted_by_id: int, user_id: int, given: dict) -> list[str]:
    """A copy of a job (resubmit, run again) by another user than its submitter takes none of
    its secret values: the names still missing from `given`, which the copy is refused without."""
    if submitted_by_id == user_id:
        return []
    return sorted(set(secret_names) - set(given or {}))


def secrets_message(job_id: int, missing: list[str]) -> str:
    names = ", ".join(missing)
    example = ", ".join(f'"{name}": "..."' for name in missing)
    return (
        f"job {job_id} was submitted by another user: its secrets are not copied; give {names} "
        f'(API: POST the resubmit with {{"secret_env": {{{example}}}}}; CLI: submit it with --secret-env NAME=VALUE; '
        "form: fill in Secret variables)"
    )


def network_problem(project, nodes: int) -> str | None:
    """A project whose jobs get loopback only cannot run ranks on several nodes."""
    if nodes > 1 and getattr(project, "network", "host") == "none":
        return (
            f"asks for {nodes} nodes, but project {project.slug}'s network policy is none (loopback only): "
            "its ranks could not reach each other; use one node, or ask for network host"
        )
    return None


def image_problem(image: str, allowed: str, project_slug: str) -> str | None:
    """A container image outside the project's allow-list (one fnmatch pattern a line; empty: any)."""
    patterns = [line.strip() for line in allowed.splitlines() if line.strip()]
    if not patterns or any(fnmatch.fnmatchcase(image, pattern) for pattern in patterns):
        return None
    return f"image {image} is not among project {project_slug}'s allowed images ({', '.join(patterns)})"


MAX_REQUIREMENTS = 500
PYTHON_VERSION = re.compile(r"^3\.\d{1,2}(?:\.\d{1,2})?$")
REQUIREMENT_EXAMPLE = "e.g. six==1.17.0, numpy>=2 or transformers[torch]"


def parse_requirements(value) -> list[str]:
    """A job's requirements (a list of specifiers, or a requirements.txt's text) as a sorted list
    of normalised specifiers; ValueError says which line is wrong and how to write it. Only named
    packages from the node's index: no options (-r, -e, --index-url) and no direct references
    (URLs, paths, git), which would read the node's files or reach anywhere as the agent."""
    lines = value.splitlines() if isinstance(value, str) else list(value)
    out = set()
    for number, raw in enumerate(lines, start=1):
        text = re.sub(r"(^|\s)#.*$", "", raw).strip()
        where = f"line {number}" if isinstance(value, str) else f"entry {number}"
        if not text:
            continue
        if text.startswith("-"):
            raise ValueError(
                f"{where} ({text!r}): options such as -r, -e or --index-url are not accepted; list packages only "
                "(the node's index is set by its operator: UV_INDEX_URL)"
            )
        try:
            requirement = Requirement(text)
        except InvalidRequirement as exc:
            raise ValueError(f"{where} ({text!r}) is not a requirement ({exc}); write {REQUIREMENT_EXAMPLE}")
        if requirement.url:
            raise ValueError(
                f"{where} ({text!r}): direct references (URLs, paths, git) are not accepted; name a package of the "
                f"index, {REQUIREMENT_EXAMPLE}"
            )
        requirement.name = canonicalize_name(requirement.name)
        out.add(str(requirement))
    if len(out) > MAX_REQUIREMENTS:
        raise ValueError(f"{len(out)} requirements; at most {MAX_REQUIREMENTS}")
    return sorted(out)


def python_problem(version: str) -> str | None:
    if not version or PYTHON_VERSION.match(version):
        return None
    return f"{version!r} is not a Python version; write e.g. 3.11 (blank: the node's python3)"


def requirements_problem(environment, requirements: list[str], python_version: str) -> tuple[str, str] | None:
    """(field, message) when the requirements cannot go with the environment asked for."""
    if not requirements and not python_version:
        return None
    if environment is not None and environment.kind == "container":
        return "requirements", f"environment {environment.name} is a container: install packages in its image"
    if environment is not None and environment.path:
        return "requirements", (
            f"environment {environment.name} is a host path ({environment.path}); requirements go with no "
            "environment or a cached one (built from requirements, e.g. ai)"
        )
    if not requirements and not (environment is not None and environment.cached):
        return "python_version", "a Python version needs requirements (the cached environment built with it)"
    return None


LAUNCHERS = ("", "ray", "torchrun")
RAY_EXAMPLE = '"requirements": ["ray==2.60.0"] (CLI: --pip ray==2.60.0)'


def names_ray(requirements) -> bool:
    """Whether one of the (normalised) specifiers is the package `ray` (with extras or not)."""
    return any(Requirement(text).name == "ray" for text in requirements or [])


def launcher_problem(launcher: str, environment, requirements: list[str]) -> str | None:
    """Why `launcher` cannot run with this environment and these requirements (None: it can).
    A Ray job runs `ray start` on each node from its environment: ray must be in it."""
    if not launcher:
        return None
    if launcher not in LAUNCHERS:
        return f"{launcher!r} is not a launcher; use ray or torchrun, or leave it out to run the command on every rank"
    if launcher == "torchrun":
        return None  # torch.distributed.run from the job's Python: a missing torch fails the start, saying so
    if environment is not None and environment.kind == "container":
        return (
            f"launcher ray starts ray on the node itself, but environment {environment.name} is a container; "
            f"drop the environment and give {RAY_EXAMPLE}"
        )
    if environment is not None and environment.path:
        return None  # an operator's virtualenv: its bin/ray is the node's business (a missing one fails the start)
    if names_ray(requirements) or (environment is not None and names_ray(environment.requirements)):
        return None
    return f"launcher ray needs ray in the job's environment: add {RAY_EXAMPLE}, or name an environment that has it"


# The first Ray that enforces RAY_AUTH_MODE=token on its GCS, raylets, dashboard and agents
# (Ray's token authentication guide). An older ray ignores the token Hangar gives each attempt:
# its cluster would take any other job's connection on its nodes.
RAY_MINIMUM = "2.52.0"
RAY_FLOOR = f"ray>={RAY_MINIMUM}"
RAY_FIX = f'ask for "{RAY_FLOOR}" (no marker), or a pin at or above it such as "ray==2.60.0"'
LOWER_BOUNDS = (">=", ">", "~=", "==", "===")


def lower_bound(requirement: Requirement) -> Version | None:
    """The least version `requirement` allows, where a clause says it (None: unbounded below)."""
    bounds = []
    for clause in requirement.specifier:
        if clause.operator in LOWER_BOUNDS:
            try:
                bounds.append(Version(clause.version.removesuffix(".*")))
            except InvalidVersion:
                continue
    return max(bounds, default=None)


def ray_version_problem(requirement: Requirement) -> str | None:
    """Why this ray requirement could install a ray that ignores the token (None: it cannot)."""
    if requirement.marker is not None:
        return f"{requirement} installs ray only where its marker holds"
    bound = lower_bound(requirement)
    if bound is None or bound < Version(RAY_MINIMUM):
        return (
            f"{requirement} allows a ray older than {RAY_MINIMUM}, the first that enforces RAY_AUTH_MODE=token "
            "(an older ray's cluster takes any other job's connection on its nodes)"
        )
    return None


def with_floor(requirement: Requirement) -> str:
    """A bare ray requirement (extras kept) bounded at RAY_MINIMUM."""
    bounded = Requirement(str(requirement))
    bounded.specifier = SpecifierSet(f">={RAY_MINIMUM}")
    return str(bounded)


def ray_requirements(own: list[str], environment) -> tuple[list[str], tuple[str, str] | None]:
    """A Ray job's own requirements, a bare ray bounded at RAY_MINIMUM; or (field, message) when
    they or its cached environment's ask for a ray that may be older. uv installs only what every
    ray requirement allows, so one bounded at the minimum is enough."""
    theirs = environment.requirements if environment is not None and environment.cached else []
    found = [(req, mine) for mine, texts in ((True, own), (False, theirs)) for req in map(Requirement, texts)]
    rays = [(req, mine) for req, mine in found if req.name == "ray"]
    if not rays or any(ray_version_problem(req) is None for req, _ in rays):
        return own, None
    loose = [(req, mine) for req, mine in rays if req.specifier or req.marker]
    if not loose:  # only bare rays: bounded here, in the job's own requirements
        bounded = [with_floor(req) if req.name == "ray" else str(req) for req in map(Requirement, own)]
        return sorted({*bounded, *([] if names_ray(own) else [RAY_FLOOR])}), None
    req, mine = loose[0]
    if mine:
        return own, ("requirements", f"{ray_version_problem(req)}; {RAY_FIX}")
    return own, (
        "environment",
        f"environment {environment.name}: {ray_version_problem(req)}; name an environment whose ray is "
        f'{RAY_MINIMUM} or newer, or none and give "requirements": ["{RAY_FLOOR}"]',
    )


def copy_for(job, spec: dict, user, given) -> dict:
    """A resubmit's or run-again's spec (reproduce.clone_data) as `user` may submit it: by
    another user than the submitter, with only the secret values `user` gives."""
    if job.submitted_by_id == getattr(user, "pk", None):
        return spec
    spec = {k: v for k, v in spec.items() if k != "secret_env"}
    if isinstance(given, dict) and given:
        spec["secret_env"] = given
    return spec


def check(attrs: dict, user, copy_of=None) -> None:
    """The submit's checks of this module over a resolved spec (jobs/submission.py), raised as
    the API's field errors; `copy_of`: the job a resubmit or run-again copies."""
    from django.conf import settings
    from rest_framework.exceptions import ValidationError

    from portal.volumes import clean_volume_path

    if (problem := network_problem(attrs["project"], attrs.get("nodes", 1))) is not None:
        raise ValidationError({"nodes": problem})
    environment = attrs.get("environment")
    container = environment is not None and environment.kind == "container"
    if problem := env_problem([*attrs.get("env", {}), *attrs.get("secret_env", {})], container):
        raise ValidationError({"env": problem})
    wanted = attrs.get("requirements") or [], attrs.get("python_version") or ""
    if problem := requirements_problem(environment, *wanted):
        raise ValidationError({problem[0]: problem[1]})
    if problem := launcher_problem(attrs.get("launcher") or "", environment, wanted[0]):
        raise ValidationError({"launcher": problem})
    if attrs.get("launcher") == "ray":
        attrs["requirements"], problem = ray_requirements(wanted[0], environment)
        if problem:
            raise ValidationError({problem[0]: problem[1]})
    if attrs.get("launcher") == "ray" and getattr(attrs["project"], "network", "host") == "none":
        raise ValidationError(
            {"launcher": f"project {attrs['project'].slug}'s network policy is none: a Ray cluster needs network host"}
        )
    project = attrs["project"]
    if container and (problem := image_problem(environment.image, project.allowed_images, project.slug)):
        raise ValidationError({"environment": problem})
    for index, volume in enumerate(attrs.get("volumes") or []):
        try:
            volume["path"] = clean_volume_path(volume["path"], settings.HANGAR_VOLUME_ROOTS)
        except ValueError as exc:
            raise ValidationError({f"volumes[{index}].name": f"volume {volume['name']} cannot be mounted: {exc}"})
    if copy_of is not None:
        user_id = getattr(user, "pk", None)
        missing = secrets_to_give(copy_of.secret_env, copy_of.submitted_by_id, user_id, attrs.get("secret_env"))
        if missing:
            raise ValidationError({"secret_env": secrets_message(copy_of.pk, missing)})
