"""`llmq batch`: submit a JSONL file as an offline batch, follow it, and fetch its results.

A plain HTTP client of the API's Files and Batch endpoints (standard library only: it
loads neither Flask nor the engine), so it works against any llmq, local or remote:
`--base-url` / `LLMQ_BASE_URL` (default http://127.0.0.1:8000) and `--api-key` /
`LLMQ_API_KEY` (sent as a Bearer token when set).

Results: the output file's lines (one per successful request, in input order) go to
stdout or `-o FILE`; the error file's lines (invalid or failed requests) go to stderr, or
next to FILE as FILE's stem + `.errors.jsonl` (`out.jsonl` -> `out.errors.jsonl`).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import urllib.error
import urllib.request
import uuid
from pathlib import Path
from typing import IO, Any

from runtime.cli_options import add_command
from workers.wire.batches import BATCH_COMPLETED, BATCH_TERMINAL
from workers.wire.job import BATCH_ENDPOINTS

DEFAULT_BASE_URL = "http://127.0.0.1:8000"
DEFAULT_ENDPOINT = "/v1/chat/completions"
TIMEOUT_SECONDS = 120.0
PLAIN_PROGRESS_SECONDS = 10.0  # progress line interval when stderr is not a terminal (a log)


BATCH_HELP = """offline batches: submit a JSONL file, follow it, fetch its results

Client of the OpenAI-compatible Batch API of a running llmq. Each line of the input file is
{"custom_id", "method": "POST", "url": ENDPOINT, "body": {...}}. Output lines go to stdout
(or -o FILE); error lines go to stderr (or to FILE's stem + .errors.jsonl).
"""
BATCH_EPILOG = "Environment: LLMQ_BASE_URL (default http://127.0.0.1:8000), LLMQ_API_KEY."


class BatchCLIError(Exception):
    """A failure worth one line on stderr (the API's own message when it sent one)."""


def add_batch_commands(sub: argparse._SubParsersAction) -> None:
    batch = add_command(sub, "batch", BATCH_HELP, epilog=BATCH_EPILOG)
    actions = batch.add_subparsers(dest="batch_command", required=True, metavar="ACTION")

    submit = actions.add_parser(
        "submit",
        help="upload FILE.jsonl and create a batch from it",
        description="Upload FILE.jsonl (purpose=batch) and create a batch. Prints the batch id "
        "on stdout; with --wait, shows progress on stderr until the batch ends, then writes "
        "its results like `llmq batch results` (exit status 0 only if it completed).",
    )
    submit.add_argument("file", type=Path, metavar="FILE.jsonl")
    submit.add_argument("--wait", action="store_true", help="follow the batch and fetch results")
    submit.add_argument(
        "--endpoint",
        choices=BATCH_ENDPOINTS,
        help="the batch's endpoint (default: the first line's url, else /v1/chat/completions)",
    )
    submit.add_argument(
        "--completion-window",
        default="24h",
        metavar="WINDOW",
        help="time the batch may take, e.g. 24h (OpenAI's only value) or 30m; default 24h",
    )
    submit.add_argument("-o", "--output", type=Path, help="with --wait: write results here")
    submit.add_argument(
        "--poll", type=float, default=1.0, metavar="SECONDS", help="status poll interval"
    )
    submit.add_argument(
        "--progress-interval",
        type=float,
        default=PLAIN_PROGRESS_SECONDS,
        metavar="SECONDS",
        help="with --wait and stderr not a terminal (a log, a pipe): a progress line at "
        "least this often",
    )
    submit.set_defaults(handler=_guarded(run_submit))

    status = actions.add_parser("status", help="print a batch (status, request counts) as JSON")
    status.add_argument("batch_id", metavar="ID")
    status.set_defaults(handler=_guarded(run_status))

    results = actions.add_parser(
        "results",
        help="write a finished batch's output (and error) lines",
        description="Output lines to stdout or -o FILE; error lines to stderr or to FILE's "
        "stem + .errors.jsonl. Fails if the batch has not ended yet.",
    )
    results.add_argument("batch_id", metavar="ID")
    results.add_argument("-o", "--output", type=Path, help="file for the output lines")
    results.set_defaults(handler=_guarded(run_results))

    for parser in (submit, status, results):
        parser.add_argument(
            "--base-url",
            default=os.environ.get("LLMQ_BASE_URL") or DEFAULT_BASE_URL,
            help="the llmq API (default: $LLMQ_BASE_URL or http://127.0.0.1:8000)",
        )
        parser.add_argument(
            "--api-key",
            default=os.environ.get("LLMQ_API_KEY") or None,
            help="sent as 'Authorization: Bearer KEY' (default: $LLMQ_API_KEY)",
        )


def _guarded(handler: Any) -> Any:
    def run(args: argparse.Namespace) -> int:
        try:
            return handler(args)
        except BatchCLIError as exc:
            print(f"llmq batch: error: {exc}", file=sys.stderr)
            return 1

    return run


# ---------------------------------------------------------------- commands


def run_submit(args: argparse.Namespace) -> int:
    client = Client(args.base_url, args.api_key)
    try:
        data = args.file.read_bytes()
    except OSError as exc:
        raise BatchCLIError(f"cannot read {args.file}: {exc.strerror}") from None
    endpoint = args.endpoint or guess_endpoint(data)
    uploaded = client.upload(args.file.name, data)
    body = {
        "input_file_id": uploaded["id"],
        "endpoint": endpoint,
        "completion_window": args.completion_window,
    }
    batch = client.json("POST", "/v1/batches", body)
    print(batch["id"], flush=True)
    if not args.wait:
        print(f"follow it with: llmq batch status {batch['id']}", file=sys.stderr)
        return 0
    batch = follow(client, batch["id"], args.poll, sys.stderr, args.progress_interval)
    write_results(client, batch, args.output)
    return 0 if batch["status"] == BATCH_COMPLETED else 1


def run_status(args: argparse.Namespace) -> int:
    batch = Client(args.base_url, args.api_key).json("GET", f"/v1/batches/{args.batch_id}")
    print(json.dumps(batch, indent=2))
    return 0


def run_results(args: argparse.Namespace) -> int:
    client = Client(args.base_url, args.api_key)
    batch = client.json("GET", f"/v1/batches/{args.batch_id}")
    if batch["status"] not in BATCH_TERMINAL:
        raise BatchCLIError(
            f"batch {batch['id']} is {batch['status']}; its results exist once it has ended"
        )
    write_results(client, batch, args.output)
    return 0


def guess_endpoint(data: bytes) -> str:
    """The first request line's url, if it names an endpoint; else DEFAULT_ENDPOINT."""
    for raw in data.splitlines():
        if raw.strip():
            try:
                url = json.loads(raw).get("url")
            except (ValueError, AttributeError):
                return DEFAULT_ENDPOINT
            return url if url in BATCH_ENDPOINTS else DEFAULT_ENDPOINT
    return DEFAULT_ENDPOINT


def follow(
    client: Client,
    batch_id: str,
    poll: float,
    out: IO[str],
    plain_interval: float = PLAIN_PROGRESS_SECONDS,
) -> dict[str, Any]:
    """Poll until the batch ends, with a progress line on `out`. Not on a terminal, the
    wait between polls never runs past the next line's due time, so a log gets a line at
    least every `plain_interval` seconds however long `poll` is."""
    progress = Progress(out, plain_interval)
    while True:
        batch = client.json("GET", f"/v1/batches/{batch_id}")
        progress.show(batch)
        if batch["status"] in BATCH_TERMINAL:
            progress.close()
            return batch
        time.sleep(min(poll, progress.until_due()))


def write_results(client: Client, batch: dict[str, Any], output: Path | None) -> None:
    out = client.content(batch["output_file_id"]) if batch.get("output_file_id") else b""
    err = client.content(batch["error_file_id"]) if batch.get("error_file_id") else b""
    if output is None:
        sys.stdout.buffer.write(out)
        sys.stdout.flush()
        sys.stderr.buffer.write(err)
        sys.stderr.flush()
        where = ""
    else:
        errors_path = errors_path_for(output)
        output.write_bytes(out)
        if err:
            errors_path.write_bytes(err)
        where = f" -> {output}" + (f", {errors_path}" if err else "")
    counts = batch.get("request_counts") or {}
    print(
        f"batch {batch['id']} {batch['status']}: {counts.get('completed', 0)} completed, "
        f"{counts.get('failed', 0)} failed of {counts.get('total', 0)}{where}",
        file=sys.stderr,
    )


def errors_path_for(output: Path) -> Path:
    """`out.jsonl` -> `out.errors.jsonl` (next to the output file)."""
    return output.with_name(f"{output.stem}.errors.jsonl")


class Progress:
    """requests done/total, tokens/s and ETA: one rewritten line on a terminal; elsewhere
    (a log file, a CI job's output) a new line every `plain_interval` seconds, since a
    rewritten line shows there only when the batch ends."""

    def __init__(self, out: IO[str], plain_interval: float = PLAIN_PROGRESS_SECONDS) -> None:
        self.out = out
        self.tty = out.isatty()
        self.plain_interval = plain_interval
        self.start = time.monotonic()
        self.first: tuple[int, int] | None = None  # (done, output tokens) at the first poll
        self.next_plain = self.start  # when the next plain line is due
        self.width = 0

    def until_due(self) -> float:
        """Seconds until the next plain line is due (unbounded on a terminal)."""
        if self.tty:
            return float("inf")
        return max(0.0, self.next_plain - time.monotonic())

    def show(self, batch: dict[str, Any]) -> None:
        counts = batch.get("request_counts") or {}
        total, failed = counts.get("total", 0), counts.get("failed", 0)
        done = counts.get("completed", 0) + failed
        tokens = (batch.get("usage") or {}).get("output_tokens", 0)
        if self.first is None:
            self.first = (done, tokens)
        elapsed = max(time.monotonic() - self.start, 1e-6)
        rate = (done - self.first[0]) / elapsed
        eta = _clock((total - done) / rate) if rate > 0 and done < total else "--:--"
        line = (
            f"{batch['id']} {batch['status']}: {done}/{total} requests ({failed} failed), "
            f"{(tokens - self.first[1]) / elapsed:.1f} tok/s, ETA {eta}"
        )
        if self.tty:
            self.out.write("\r" + line.ljust(self.width))
            self.width = len(line)
            self.out.flush()
        elif time.monotonic() >= self.next_plain or batch["status"] in BATCH_TERMINAL:
            self.next_plain = time.monotonic() + self.plain_interval
            print(line, file=self.out, flush=True)

    def close(self) -> None:
        if self.tty:
            self.out.write("\n")
            self.out.flush()


def _clock(seconds: float) -> str:
    seconds = int(seconds)
    hours, rest = divmod(seconds, 3600)
    return f"{hours}:{rest // 60:02d}:{rest % 60:02d}" if hours else f"{rest // 60}:{rest % 60:02d}"


# ---------------------------------------------------------------- HTTP


class Client:
    def __init__(self, base_url: str, api_key: str | None, timeout: float = TIMEOUT_SECONDS):
        self.base = base_url.rstrip("/").removesuffix("/v1")
        self.api_key = api_key
        self.timeout = timeout

    def json(self, method: str, path: str, payload: Any = None) -> dict[str, Any]:
        data = None if payload is None else json.dumps(payload).encode()
        raw = self._send(method, path, data, "application/json" if data else None)
        return json.loads(raw)

    def content(self, file_id: str) -> bytes:
        return self._send("GET", f"/v1/files/{file_id}/content")

    def upload(self, filename: str, data: bytes) -> dict[str, Any]:
        boundary = f"llmq-{uuid.uuid4().hex}"
        safe_name = filename.replace('"', "_").replace("\r", "_").replace("\n", "_")
        head = (
            f'--{boundary}\r\nContent-Disposition: form-data; name="purpose"\r\n\r\nbatch\r\n'
            f'--{boundary}\r\nContent-Disposition: form-data; name="file"; '
            f'filename="{safe_name}"\r\nContent-Type: application/jsonl\r\n\r\n'
        ).encode()
        body = head + data + f"\r\n--{boundary}--\r\n".encode()
        raw = self._send("POST", "/v1/files", body, f"multipart/form-data; boundary={boundary}")
        return json.loads(raw)

    def _send(
        self, method: str, path: str, data: bytes | None = None, content_type: str | None = None
    ) -> bytes:
        headers = {"Accept": "application/json"}
        if content_type:
            headers["Content-Type"] = content_type
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        request = urllib.request.Request(self.base + path, data, headers, method=method)
        try:
            with urllib.request.urlopen(request, timeout=self.timeout) as response:
                return response.read()
        except urllib.error.HTTPError as exc:
            raise BatchCLIError(f"{method} {path}: {exc.code} {_message(exc)}") from None
        except (urllib.error.URLError, OSError) as exc:
            reason = getattr(exc, "reason", exc)
            raise BatchCLIError(f"cannot reach the llmq API at {self.base}: {reason}") from None


def _message(exc: urllib.error.HTTPError) -> str:
    try:
        return str(json.loads(exc.read())["error"]["message"])
    except (ValueError, KeyError, TypeError, OSError):
        return exc.reason or "error"
