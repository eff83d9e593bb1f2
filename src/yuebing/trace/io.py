"""Reading and writing Mooncake JSONL traces.

`load_trace` decodes each line with a typed msgspec decoder straight into a frozen `Request`
(≈ 10 µs per line, so the 12,031-line conversation trace loads in well under 0.5 s), then checks
what a type cannot say: ``hash_ids`` may not name more blocks than the prompt covers. The first
malformed line raises `TraceFormatError` naming file, 1-based line and field; nothing is
returned on error. Blank lines are skipped; unknown extra keys are ignored (forward
compatibility). Decreasing timestamps are accepted here and reported by `trace_stats`.
`write_trace` writes the same format back (keys in the canonical order).
"""

from __future__ import annotations

import logging
import re
import time
from pathlib import Path

import msgspec

from yuebing.core.errors import InputError, TraceFormatError
from yuebing.trace.model import BLOCK_SIZE, Request, Trace, blocks_needed

log = logging.getLogger(__name__)
_DECODER = msgspec.json.Decoder(Request)
_ENCODER = msgspec.json.Encoder()
_AT_RE = re.compile(r"^(?P<problem>.*?) - at `\$\.?(?P<field>[^`]*)`$")
_MISSING_RE = re.compile(r"^Object missing required field `(?P<field>[^`]+)`$")
WHOLE_LINE = "(line)"
"""Field name used in errors about the line as a whole (bad JSON, not an object)."""


def _describe(err: msgspec.ValidationError) -> tuple[str, str]:
    """(field, problem) from a msgspec validation message."""
    text = str(err)
    m = _MISSING_RE.match(text)
    if m:
        return m.group("field"), "missing required field"
    m = _AT_RE.match(text)
    if m:
        problem = m.group("problem")
        return m.group("field") or WHOLE_LINE, problem[:1].lower() + problem[1:]
    if text.startswith("Expected `object`"):
        return WHOLE_LINE, "expected a JSON object" + text[len("Expected `object`"):]
    return WHOLE_LINE, text


def parse_line(raw: bytes, path: str, line_no: int, block_size: int = BLOCK_SIZE) -> Request:
    """Decode and validate one trace line; raises `TraceFormatError` on any problem."""
    try:
        req = _DECODER.decode(raw)
    except msgspec.ValidationError as e:
        field, problem = _describe(e)
        raise TraceFormatError(path, line_no, field, problem) from None
    except msgspec.DecodeError as e:
        raise TraceFormatError(path, line_no, WHOLE_LINE, f"invalid JSON: {e}") from None
    limit = blocks_needed(req.input_length, block_size)
    if len(req.hash_ids) > limit:
        raise TraceFormatError(
            path, line_no, "hash_ids",
            f"{len(req.hash_ids)} block ids but input_length {req.input_length} covers only "
            f"{limit} blocks of {block_size} tokens")
    return req


def parse_lines(data: bytes, path: str, block_size: int = BLOCK_SIZE) -> list[Request]:
    """All requests of a JSONL document (blank lines skipped)."""
    requests: list[Request] = []
    append = requests.append
    for line_no, raw in enumerate(data.split(b"\n"), start=1):
        if raw.strip():
            append(parse_line(raw, path, line_no, block_size))
    return requests


def load_trace(path: str | Path, block_size: int = BLOCK_SIZE) -> Trace:
    """Load and validate a Mooncake JSONL trace file.

    Raises `InputError` if the file cannot be read and `TraceFormatError` (file, line, field)
    for the first malformed line or for a file without any request.
    """
    p = Path(path)
    t0 = time.perf_counter()
    try:
        data = p.read_bytes()
    except OSError as e:
        raise InputError(f"cannot read trace {str(p)!r}: {e.strerror or e}") from None
    requests = parse_lines(data, str(p), block_size)
    if not requests:
        raise TraceFormatError(str(p), 0, WHOLE_LINE, "the file holds no requests")
    log.debug("loaded %d requests from %s in %.3f s", len(requests), p, time.perf_counter() - t0)
    return Trace(tuple(requests), block_size, str(p))


def dumps_trace(trace: Trace) -> bytes:
    """The trace as JSONL bytes, one request per line, in the trace's order."""
    return b"".join(_ENCODER.encode(r) + b"\n" for r in trace.requests)


def write_trace(trace: Trace, path: str | Path) -> Path:
    """Write ``trace`` as JSONL to ``path`` (atomically: a temporary file, then rename)."""
    p = Path(path)
    tmp = p.with_name(p.name + ".tmp")
    try:
        tmp.write_bytes(dumps_trace(trace))
        tmp.replace(p)
    except OSError as e:
        tmp.unlink(missing_ok=True)
        raise InputError(f"cannot write trace {str(p)!r}: {e.strerror or e}") from None
    return p
