"""User-supplied regular expressions, compiled by RE2 (google-re2): matching time is
linear in the text, whatever the pattern.

Python's `re` backtracks and holds the interpreter lock while it does: `(a+)+$` against
27 a's and a `!` took 7.7 s and stalled every other request of the web process. Every
pattern a user supplies (log search and its highlighting, SQLite's REGEXP, the log
websocket) goes through `compile_user_pattern`; PostgreSQL runs its own regex engine
under the log reads' statement timeout (jobs.logquery.bounded).
"""

import functools

import re2

from portal.inputs import InputError

MAX_PATTERN_CHARS = 500
# RE2's budget for one compiled program: a pattern past it (`(\w{1,100}){100}`) is refused,
# not run. RE2 itself refuses counted repeats nested past 1000 (`(a{100}){100}`).
MAX_PROGRAM_BYTES = 1 << 20


class PatternError(InputError):
    """A pattern refused, with the request field it came from."""


def compile_user_pattern(text: str, field: str = "q", regex: bool = True, ignore_case: bool = True):
    """`text` compiled by RE2 (escaped first when not `regex`); PatternError naming `field`
    when it is too long, invalid, or too big a program."""
    if len(text) > MAX_PATTERN_CHARS:
        raise PatternError(field, f"is {len(text)} characters long; use at most {MAX_PATTERN_CHARS}")
    try:
        return linear(text if regex else re2.escape(text), ignore_case)
    except re2.error as exc:
        reason = exc.args[0].decode(errors="replace") if exc.args and isinstance(exc.args[0], bytes) else str(exc)
        if "too large" in reason or "repetition size" in reason:
            reason = f"too complex ({reason}); use fewer or smaller counted repeats like {{1,100}}"
        raise PatternError(
            field,
            f"is not a regular expression this server runs ({reason}); RE2 syntax, no backreferences or "
            "lookarounds; or search plain text: regex=0",
        ) from None


@functools.lru_cache(maxsize=256)
def linear(pattern: str, ignore_case: bool = False):
    """`pattern` compiled by RE2, linear in what it reads whatever the pattern: for users' patterns
    (compile_user_pattern checks them first) and for Hangar's own over text a job wrote."""
    options = re2.Options()
    options.max_mem = MAX_PROGRAM_BYTES
    options.log_errors = False
    options.case_sensitive = not ignore_case
    return re2.compile(pattern, options)


def sqlite_regexp(pattern: str | None, string) -> bool | None:
    """SQLite's REGEXP (Django's `__regex`/`__iregex` lookups) on RE2 instead of `re`."""
    if pattern is None or string is None:
        return None
    ignore_case = pattern.startswith("(?i)")
    compiled = linear(pattern[4:] if ignore_case else pattern, ignore_case)
    return compiled.search(string if isinstance(string, str) else str(string)) is not None


def install_sqlite_regexp(sender, connection, **kwargs) -> None:
    """connection_created: replace the REGEXP function Django registered with `re`'s."""
    if connection.vendor == "sqlite":
        connection.connection.create_function("REGEXP", 2, sqlite_regexp, deterministic=True)
