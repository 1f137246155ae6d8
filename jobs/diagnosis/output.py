"""Reading a rank's output as Python prints it: tracebacks (frames, the source lines Python
echoes under them, chained exceptions, a SyntaxError's location), warnings, and the lines that
are echoes of source code rather than messages. Pure: no database.

An echoed source line is the program's text, not what happened: `loss = float("nan")` under a
frame says nothing about the loss. Keyword recognisers never read echoes (`Scan.echoes`).
"""

from dataclasses import dataclass, field

import re2

from portal.patterns import linear  # RE2: a line a job crafts cannot hold the reader (re backtracks)

_RANK_PREFIX = linear(r"^\[rank\d+\]:\s?")
_FRAME = linear(r'^(?P<indent>\s*)File "(?P<path>[^"]+)", line (?P<line>\d+)(?:, in (?P<func>\S+))?\s*$')
_EXC = linear(r"^(?P<type>[A-Za-z_][\w.]*)(?::\s?(?P<msg>.*))?$")
_WARNING = linear(r"^\S.*:\d+: [A-Z]\w*Warning: ")
_CARETS = linear(r"^\s*[\^~]+\s*$")
_CHAIN = ("During handling of the above exception", "The above exception was the direct cause")
_NOISE = ("Exception ignored in", "Error in atexit._run_exitfuncs")  # tracebacks printed at shutdown
LIBRARY = ("site-packages", "dist-packages", "/lib/python3", "<frozen", "/usr/lib/python")
_WORKDIR = linear(r"/(?:hangar-job-[^/]+|jobs/\d+(?:/code-\d+-\d+)?)/(?P<rest>.+)$")
SYNTAX_ERRORS = ("SyntaxError", "IndentationError", "TabError")


@dataclass(frozen=True)
class Line:
    seq: int
    text: str
    rank: int = 0
    node: str = ""
    stream: str = "stdout"  # stdout | stderr | system
    attempt: int = 0


def strip(text: str) -> str:
    """A line without the `[rankN]: ` prefix torch.distributed puts on each rank's lines."""
    return _RANK_PREFIX.sub("", text, count=1) if text.startswith("[rank") else text


def indent(text: str) -> int:
    return len(text) - len(text.lstrip(" "))


@dataclass
class Frame:
    line: Line
    path: str  # as Python printed it: a file, or `<string>` for code run by exec
    lineno: int
    func: str  # "" for a SyntaxError's location, which names no function
    source: str = ""  # the source line: as Python echoed it, or read from the file found for `<string>`
    resolved: str = ""  # the job's file a `<string>` frame ran, when found

    @property
    def shown(self) -> str:
        """The frame's file as the user knows it: relative to the job's working directory."""
        return self.resolved or short_path(self.path)

    @property
    def is_library(self) -> bool:
        return not self.resolved and any(part in self.path for part in LIBRARY)

    def where(self) -> str:
        return f"{self.shown}:{self.lineno}" + (f" in {self.func}" if self.func else "")


@dataclass
class Traceback:
    start: Line
    frames: list[Frame] = field(default_factory=list)
    exc_line: Line | None = None
    exc_type: str = ""
    message: str = ""
    chained: bool = False  # printed as the consequence of the traceback before it
    noise: bool = False  # printed at shutdown (`Exception ignored in`, atexit): not what ended the run
    syntax_text: str = ""  # a SyntaxError's offending text, as Python shows it

    @property
    def short_type(self) -> str:
        return self.exc_type.rsplit(".", 1)[-1]

    def user_frame(self) -> Frame | None:
        """The deepest frame in the user's own files (not the libraries'), else the deepest."""
        own = [f for f in self.frames if not f.is_library]
        return own[-1] if own else (self.frames[-1] if self.frames else None)


def short_path(path: str) -> str:
    """A file as the user knows it: relative to the job's working directory when it is there
    (a code snapshot's copy, /…/jobs/<id>/code-<attempt>-<rank>/), a library's by its name."""
    if match := _WORKDIR.search(path):
        return match["rest"]
    return path.rsplit("/", 1)[-1] if any(part in path for part in LIBRARY) else path


@dataclass
class Scan:
    tracebacks: list[Traceback] = field(default_factory=list)
    inside: set[int] = field(default_factory=set)  # seqs of traceback lines (frames, echoes, the exception)
    echoes: set[int] = field(default_factory=set)  # seqs of source lines Python echoed (frames', warnings')


def scan(lines: list[Line]) -> Scan:
    """Tracebacks and echoes in one rank's lines. Each stream is read on its own: a traceback on
    stderr is never interrupted by what the program printed on stdout meanwhile."""
    out = Scan()
    for stream in {line.stream for line in lines}:
        scan_stream([x for x in lines if x.stream == stream], out)
    out.tracebacks.sort(key=lambda t: t.start.seq)
    return out


def scan_stream(lines: list[Line], out: Scan) -> None:
    current: Traceback | None = None
    echo_below: int | None = None  # lines indented deeper than this are the last frame's (or warning's) echo
    chained = noise = False
    for line in lines:
        text = strip(line.text)
        if echo_below is not None and text.strip() and (indent(text) > echo_below or _CARETS.match(text)):
            out.echoes.add(line.seq)
            if current is not None and current.exc_line is None:
                out.inside.add(line.seq)
                take_source(current, text)
            continue
        echo_below = None
        if text.startswith(_CHAIN):
            chained = True
        elif text.startswith(_NOISE):
            noise = True
        if text.startswith("Traceback (most recent call last):"):
            current = Traceback(line, chained=chained, noise=noise)
            out.tracebacks.append(current)
            out.inside.add(line.seq)
            chained = noise = False
        elif frame := _FRAME.match(text):
            if (current is None or current.exc_line is not None) and frame["func"] is None:
                current = Traceback(line)  # a SyntaxError in the main script: Python prints no header
                out.tracebacks.append(current)
            if current is not None and current.exc_line is None:
                current.frames.append(Frame(line, frame["path"], int(frame["line"]), frame["func"] or ""))
                out.inside.add(line.seq)
            echo_below = len(frame["indent"])
        elif _WARNING.match(text):
            echo_below = indent(text)
        elif current is not None and current.exc_line is None and current.frames:
            out.inside.add(line.seq)
            if indent(text) == 0 and (exc := _EXC.match(text)):
                current.exc_line, current.exc_type, current.message = line, exc["type"], exc["msg"] or ""
    out.tracebacks[:] = [t for t in out.tracebacks if t.exc_line is not None]


def take_source(tb: Traceback, text: str) -> None:
    """An echoed line is its frame's source; under a SyntaxError's location, the offending text."""
    frame = tb.frames[-1]
    if frame.source or _CARETS.match(text):
        return
    frame.source = text.strip()
    if not frame.func:
        tb.syntax_text = frame.source


def chains(tracebacks: list[Traceback]) -> list[list[Traceback]]:
    """Tracebacks grouped by exception chain (`During handling…`, `The above exception was the
    direct cause…`): one failure each, its root cause first."""
    out: list[list[Traceback]] = []
    for tb in tracebacks:
        if tb.chained and out:
            out[-1].append(tb)
        else:
            out.append([tb])
    return out


# --- code run by exec: `File "<string>"` ------------------------------------------------------

_EXEC_OF = linear(
    r"""exec\(\s*(?:compile\(\s*)?(?:open\(\s*['"](?P<a>[^'"]+)['"]"""
    r"""|(?:pathlib\.)?Path\(\s*['"](?P<b>[^'"]+)['"]\s*\)\.read_text)"""
)
_NAME = linear(r"name '(?P<name>[^']{1,200})' is not defined|'(?P<key>[^']{1,200})'")  # a name, not a paragraph


Sources = dict[str, list[str]]  # the job's files a `<string>` frame may have run: relative path -> its lines


def sources_of(files: dict[str, str]) -> Sources:
    """Each file cut into lines once: a traceback may hold as many `<string>` frames as it likes."""
    return {path: text.splitlines() for path, text in files.items()}


def resolve(tb: Traceback, files: Sources, command: tuple[str, ...] = ()) -> None:
    """Name the job's file behind each `<string>` frame (code run by `exec`, as nanoGPT's
    configurator.py runs the config file named on its command line), with its source line.
    `files`: candidate files, from the command's arguments and the job's code."""
    if not files:
        return
    for i, frame in enumerate(tb.frames):
        if frame.path != "<string>":
            continue
        caller = tb.frames[i - 1] if i else None
        path = exec_literal(caller, files) or by_content(frame, tb, files, command, i == len(tb.frames) - 1)
        if path:
            frame.resolved = path
            text = source_line(files[path], frame.lineno)
            frame.source = frame.source or text
            if not frame.func and not tb.syntax_text:
                tb.syntax_text = text


def exec_literal(caller: Frame | None, files: Sources) -> str | None:
    """The file the calling line names literally: `exec(open("configurator.py").read())`."""
    if caller is None:
        return None
    text = caller.source or source_line(files.get(caller.resolved, []), caller.lineno)
    match = _EXEC_OF.search(text)
    return find_file(match["a"] or match["b"], files) if match else None


def by_content(frame: Frame, tb: Traceback, files: Sources, command: tuple[str, ...], last: bool) -> str | None:
    """The candidate whose line holds what Python showed of the error: the SyntaxError's text, or
    the name of a NameError (or the key of a KeyError); for the innermost frame with no such token,
    the one file named on the command line that is long enough."""
    fits = {path: text for path, rows in files.items() if (text := source_line(rows, frame.lineno))}
    if not frame.func and frame.source:
        token = frame.source.strip()
        matched = [p for p, text in fits.items() if text.strip() == token]
    elif last and (name := _NAME.search(tb.message)):
        token = name["name"] or name["key"]
        word = linear(rf"(?:^|\W){re2.escape(token)}(?:\W|$)")
        matched = [p for p, text in fits.items() if word.search(text)]
    else:
        named = [p for p in fits if p in command_files(command)]
        matched = named if last and len(named) == 1 else []
    if len(matched) > 1:
        matched = [p for p in matched if p in command_files(command)] or matched
    return matched[0] if len(matched) == 1 else None


def find_file(name: str, files: Sources) -> str | None:
    name = name.removeprefix("./")
    for path in files:
        if path == name or path.endswith("/" + name) or name.endswith("/" + path):
            return path
    return None


def source_line(rows: list[str], lineno: int) -> str:
    return rows[lineno - 1].strip() if 0 < lineno <= len(rows) else ""


_FILE_ARG = linear(r"^[\w./-]+\.(?:py|json|ya?ml|toml|cfg|ini|txt)$")


def command_files(command: tuple[str, ...]) -> list[str]:
    """The relative file paths a command names: `train.py config/x.py --cfg=a.yaml --data b.json`."""
    out = []
    for arg in command[1:]:
        value = arg.split("=", 1)[1] if arg.startswith("-") and "=" in arg else arg
        if _FILE_ARG.match(value) and not value.startswith(("/", "-")):
            out.append(value.removeprefix("./"))
    return out


def wanted_files(lines: list[Line], command: tuple[str, ...]) -> list[str]:
    """The job's files worth reading to resolve `<string>` frames (none when there are none): the
    command's file arguments and the files the echoed lines exec by name."""
    texts = [strip(x.text) for x in lines]
    if not any('File "<string>"' in t for t in texts):
        return []
    named = [m["a"] or m["b"] for t in texts if (m := _EXEC_OF.search(t))]
    return list(dict.fromkeys([*command_files(command), *(n.removeprefix("./") for n in named)]))
