"""Structured (JSON-lines) logging; every record may carry a request id, and one logged
inside a traced span carries its trace and span ids."""

from __future__ import annotations

import json
import logging
import os
import re
import sys
import time

from runtime import tracing

_FIELDS = ("request_id", "conv_id", "model", "event", "count", "seconds", "component")


#: Credentials never reach a log: a key in a query string (an access log line) or a header.
_SECRETS = re.compile(r"(?i)\b(api[_-]?key|access_token|token|key)=[^&\s\"']+|(bearer\s+)[^\s\"']+")


def redact(text: str) -> str:
    return _SECRETS.sub(lambda m: f"{m.group(1)}=[redacted]" if m.group(1) else f"{m.group(2)}[redacted]", text)


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        out = {
            "ts": round(time.time(), 3),
            "level": record.levelname,
            "logger": record.name,
            "msg": redact(record.getMessage()),
        }
        for key in _FIELDS:
            value = getattr(record, key, None)
            if value is not None:
                out[key] = value
        if tracing.enabled():  # a record logged inside a span names its trace
            out.update(tracing.log_ids())
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        return json.dumps(out, ensure_ascii=False)


def output_to(path: str) -> None:
    """Point this process's stdout and stderr (the log handler's stream among them) at the
    file ``path``, appended to."""
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    for target in (1, 2):
        os.dup2(fd, target)
    os.close(fd)


def setup(level: str = "INFO", process: str | None = None) -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    if process:
        old = logging.getLogRecordFactory()

        def factory(*args, **kwargs):
            record = old(*args, **kwargs)
            record.component = process
            return record

        logging.setLogRecordFactory(factory)
