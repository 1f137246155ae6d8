import re
import shlex

from django import forms
from django.conf import settings

from fleet.models import Node
from jobs.models import Environment, priority_classes
from portal.api.shape import flatten
from portal.models import Project, Role


class SecretTextarea(forms.Textarea):
    def format_value(self, value) -> str:
        return ""  # secrets are never shown back, not even when the form comes back with an error


class JobForm(forms.Form):
    """The browser's view of a submission. It only turns text into the API's
    shape; the API serializer validates, so both refuse the same things."""

    name = forms.CharField(max_length=200, required=False, help_text="Defaults to the program's name.")
    project = forms.ChoiceField()
    command = forms.CharField(
        widget=forms.TextInput(attrs={"placeholder": "python train.py --epochs 3", "class": "mono"}),
        help_text="Split like a shell line (quotes group words) and run as an argv list, never through a shell.",
    )
    gpus_per_node = forms.IntegerField(label="GPUs per node", initial=1)
    nodes = forms.IntegerField(
        initial=1, required=False, help_text="More than one: one rank per node, all started at once."
    )
    gpu_type = forms.ChoiceField(label="GPU type", required=False)
    priority = forms.ChoiceField(required=False, help_text="Blank: the project's default class.")
    environment = forms.ChoiceField(required=False)
    requirements = forms.CharField(
        label="Python requirements",
        required=False,
        widget=forms.Textarea(attrs={"rows": 3, "placeholder": "six==1.17.0\nnumpy>=2", "class": "mono"}),
        help_text="A requirements.txt (one package a line): its environment is built once per node (uv), then reused.",
    )
    python_version = forms.CharField(
        label="Python version",
        required=False,
        max_length=16,
        help_text="With requirements, e.g. 3.11; blank: the node's.",
    )
    launcher = forms.ChoiceField(
        choices=[
            ("", "the command on every rank"),
            ("torchrun", "torchrun: one process per GPU (torch.distributed.run)"),
            ("ray", "Ray: a cluster of its nodes, the command as driver"),
        ],
        required=False,
        help_text="torchrun needs torch in the job's Python. Ray needs ray in its requirements (e.g. ray==2.60.0): "
        "rank 0 runs the command with RAY_ADDRESS set.",
    )
    max_retries = forms.IntegerField(
        label="Retries", initial=0, required=False, help_text="Times to run it again if the command itself fails."
    )
    stop_on_hang = forms.BooleanField(
        label="Stop on a suspected hang",
        required=False,
        help_text="End the attempt when a rank stays silent while the others print (HANGAR_HANG_SECONDS).",
    )
    max_runtime_seconds = forms.IntegerField(
        label="Max runtime (seconds)",
        initial=settings.HANGAR_DEFAULT_MAX_RUNTIME_SECONDS,
        help_text="The job is stopped after this long (3600 = one hour).",
    )
    env = forms.CharField(
        label="Environment variables",
        required=False,
        widget=forms.Textarea(attrs={"rows": 3, "placeholder": "KEY=value, one per line", "class": "mono"}),
    )
    depends_on = forms.CharField(
        label="After jobs",
        required=False,
        widget=forms.TextInput(attrs={"placeholder": "12, 13:finished", "class": "mono"}),
        help_text="Start only after these jobs succeeded (JOB:finished: ended in any way).",
    )
    secret_env = forms.CharField(
        label="Secret variables",
        required=False,
        widget=SecretTextarea(attrs={"rows": 2, "placeholder": "KEY=value, one per line", "class": "mono"}),
        help_text="Given to the job, never shown again (masked on the job page and in the API).",
    )

    def __init__(self, user, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.fields["project"].choices = [(p.slug, p.name) for p in Project.objects.with_role(user, Role.MEMBER)]
        types = sorted(set(Node.objects.values_list("gpu_model", flat=True)))
        self.fields["gpu_type"].choices = [("", "any")] + [(t, t) for t in types]
        self.fields["priority"].choices = [("", "project default")] + [(n, n) for n in priority_classes()]
        envs = Environment.objects.values_list("name", "description")
        self.fields["environment"].choices = [("", "host (none)")] + [(n, f"{n}: {d}" if d else n) for n, d in envs]

    def clean_command(self) -> list[str]:
        try:
            return shlex.split(self.cleaned_data["command"])
        except ValueError as exc:
            raise forms.ValidationError(f"cannot split this line ({exc}); check the quotes")

    def clean_depends_on(self) -> list[dict]:
        deps = []
        for item in filter(None, (part.strip() for part in self.cleaned_data["depends_on"].split(","))):
            job, _, condition = item.partition(":")
            if not job.isdigit() or condition not in ("", "succeeded", "finished"):
                raise forms.ValidationError(f"{item!r}: write a job id, or JOB:finished, e.g. 12, 13:finished")
            deps.append({"job": int(job), "on": condition or "succeeded"})
        return deps

    def clean_env(self) -> dict[str, str]:
        return parse_env(self.cleaned_data["env"])

    def clean_secret_env(self) -> dict[str, str]:
        return parse_env(self.cleaned_data["secret_env"])

    def api_data(self) -> dict:
        data = dict(self.cleaned_data)
        return {key: value for key, value in data.items() if value not in ("", None)}

    def add_api_errors(self, errors: dict) -> None:
        """The API's errors on the form's fields (the API's names are the form's); an error of
        a part of a field (`depends_on[0].job`, `env.A`) goes on that field, naming the part."""
        for error in flatten(errors):
            path = error["field"]
            base = re.split(r"[.\[]", path, maxsplit=1)[0]
            target = base if base in self.fields else None
            self.add_error(target, error["message"] if path in (base, "") else f"{path}: {error['message']}")


def parse_env(text: str) -> dict[str, str]:
    env = {}
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        key, sep, value = line.partition("=")
        if not sep:
            raise forms.ValidationError(f"line {number} is not KEY=value")
        env[key.strip()] = value
    return env
