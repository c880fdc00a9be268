"""`molt-view RUN_DIR [RUN_DIR...]`: a local web page of runs' metrics and saved rollouts (`--log.rollouts`).

One page (`page.html`: the curves in SVG, a step's episodes by prompt group,
one episode as a conversation and as tokens coloured by logprob, mismatch,
staleness or mask, side by side with the same prompt in another run or step)
and the JSON it reads:

    GET /                                          the page
    GET /api/runs                                  each run: name, config, metric keys, steps with rollouts
    GET /api/run/{run}/metrics?key=K[&key=K]       a metric's (step, value) points, for each key
    GET /api/run/{run}/step/{step}/episodes?...    a step's episodes: filtered, sorted, a page at a time
    GET /api/run/{run}/step/{step}/episode?rollout=ID    one episode: its segments' messages and tokens

A run is addressed by its place on the command line (0, 1, ...), never by a
path, and the only files read are those a run directory holds (`runs.Run`).
A bad request is answered 4xx with `{"error": ..., "parameter": ...}`. Every
request first reads what a live run appended since the last one.
"""

from __future__ import annotations

import argparse
import json
import math
import socket
import sys
from importlib import resources
from pathlib import Path
from typing import Literal

import uvicorn
from fastapi import FastAPI, Query, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import HTMLResponse, JSONResponse
from starlette.exceptions import HTTPException

from molt_train.view import runs as run_files
from molt_train.view.runs import BadRequest, NotFound, Run


class JSON(JSONResponse):
    """JSON with a number that is not finite (a NaN reward, a -inf logprob) as null: the browser's JSON.parse
    reads no NaN."""

    def render(self, content) -> bytes:
        try:
            text = json.dumps(content, allow_nan=False, separators=(",", ":"))
        except ValueError:
            text = json.dumps(_finite(content), separators=(",", ":"))
        return text.encode()


def _finite(value):
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {key: _finite(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(item) for item in value]
    return value


def _error(status: int, parameter: str | None, message: str) -> JSON:
    return JSON({"error": message, "parameter": parameter}, status_code=status)


def make_app(run_dirs: list[Path]) -> FastAPI:
    """The viewer's app over these run directories (each holding a metrics.jsonl)."""
    names = [d.resolve().name for d in run_dirs]
    runs = [Run(d, f"{d.resolve().parent.name}/{name}" if names.count(name) > 1 else name)
            for d, name in zip(run_dirs, names)]
    page = resources.files("molt_train.view").joinpath("page.html").read_text()
    app = FastAPI(title="molt-view", docs_url=None, redoc_url=None, openapi_url=None, default_response_class=JSON)

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, error: RequestValidationError):
        first = error.errors()[0]
        parameter = str(first["loc"][-1]) if first.get("loc") else None
        return _error(422, parameter, f"{parameter}: {first.get('msg')}")

    @app.exception_handler(NotFound)
    async def not_found(request: Request, error: NotFound):
        return _error(404, error.parameter, str(error))

    @app.exception_handler(BadRequest)
    async def bad_request(request: Request, error: BadRequest):
        return _error(400, error.parameter, str(error))

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, error: HTTPException):  # no such route, a wrong method
        return _error(error.status_code, None, f"{request.url.path}: {error.detail}")

    def run_at(index: int) -> Run:
        if not 0 <= index < len(runs):
            raise NotFound("run", f"run {index}: no such run; the runs are 0..{len(runs) - 1}, in the order "
                                  "given to molt-view")
        run = runs[index]
        run.refresh()
        return run

    @app.get("/", response_class=HTMLResponse)
    def index():
        return HTMLResponse(page)

    @app.get("/api/runs")
    def list_runs():
        return JSON([{"run": i, **run_at(i).summary()} for i in range(len(runs))])

    @app.get("/api/run/{run}/metrics")
    def metrics(run: int, key: list[str] = Query(min_length=1, description="metric names, e.g. reward/mean")):
        return JSON({"run": run, "series": run_at(run).series(key)})

    @app.get("/api/run/{run}/step/{step}/episodes")
    def episodes(run: int, step: int, split: Literal["train", "eval"] | None = None,
                 sort: str = "group", order: Literal["asc", "desc"] = "asc",
                 page: int = Query(0, ge=0), page_size: int = Query(50, ge=1, le=500),
                 truncated: bool | None = None, trained: bool | None = None,
                 min_reward: float | None = None, max_reward: float | None = None,
                 info: list[str] = Query([], description="KEY=VALUE, an env info field's value"),
                 q: str | None = Query(None, description="text in the prompt"), prompt_id: str | None = None):
        rows = run_at(run).episodes(step)
        chosen = run_files.select(rows, split=split, truncated=truncated, trained=trained, min_reward=min_reward,
                                  max_reward=max_reward, info=info, q=q, prompt_id=prompt_id)
        chosen = run_files.order(chosen, sort, order == "desc")
        pages = max(1, -(-len(chosen) // page_size))
        if page >= pages:
            raise NotFound("page", f"page {page}: this selection has {pages} page(s) of {page_size} (0..{pages - 1})")
        shown = chosen[page * page_size:(page + 1) * page_size]
        groups = {row["group"] for row in shown}
        return JSON({"run": run, "step": step, "total": len(chosen), "episodes": len(rows), "page": page,
                     "pages": pages, "page_size": page_size, "rows": [_public(row) for row in shown],
                     "groups": run_files.group_stats([row for row in chosen if row["group"] in groups]),
                     "splits": {split: sum(r["split"] == split for r in rows) for split in ("train", "eval")},
                     "info_keys": run_files.info_keys(rows)})

    @app.get("/api/run/{run}/step/{step}/episode")
    def episode(run: int, step: int, rollout: str = Query(description="the episode's rollout_id")):
        found = run_at(run).episode(step, rollout)
        segments = [{"segment": record.get("segment", 0), "num_segments": record.get("num_segments", 1),
                     "finish_reason": record.get("finish_reason"), "truncated": record.get("truncated"),
                     "trained": record.get("trained"), "advantage": record.get("advantage"),
                     "messages": run_files.conversation(record.get("messages") or []),
                     "tokens": {"ids": record["token_ids"], "pieces": runs[run].pieces(record["token_ids"]),
                                "mask": record["mask"], "logprobs": record["logprobs"],
                                "trainer_logprobs": record.get("trainer_logprobs"), "versions": record["versions"]}}
                    for record in found["records"]]
        row = found["row"]
        return JSON({"run": run, "step": step, "row": _public(row), "info": found["records"][-1].get("info"),
                     "held_version": runs[run].held_version(step, row["split"]), "segments": segments})

    return app


def _public(row: dict) -> dict:
    """A row without where its records lie."""
    return {key: value for key, value in row.items() if key not in ("where", "last_segment")}


# ----------------------------------------------------------------------
# CLI


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="molt-view", description="A local web page of runs' metrics and saved "
                                     "rollouts (molt-train --log.rollouts true); live while a run writes.")
    parser.add_argument("run_dirs", nargs="+", type=Path, metavar="RUN_DIR", help="a molt-train --out directory")
    parser.add_argument("--host", default="127.0.0.1",
                        help="address to listen on (default: this machine only; the page shows what the runs hold)")
    parser.add_argument("--port", type=int, default=8765, help="port to listen on; 0 = any free port")
    args = parser.parse_args(argv)
    for run_dir in args.run_dirs:
        if not (run_dir / "metrics.jsonl").is_file():
            print(f"molt-view: {run_dir}: no metrics.jsonl; pass the --out directory of a molt-train run",
                  file=sys.stderr)
            sys.exit(2)
    app = make_app(args.run_dirs)
    listener = socket.socket(socket.AF_INET6 if ":" in args.host else socket.AF_INET)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        listener.bind((args.host, args.port))
    except OSError as error:
        print(f"molt-view: cannot listen on {args.host}:{args.port} ({error.strerror}); choose another --port",
              file=sys.stderr)
        sys.exit(2)
    host, port = listener.getsockname()[:2]
    shown = f"[{host}]" if ":" in host else host
    print(f"molt-view: {len(args.run_dirs)} run(s) at http://{shown}:{port}/", flush=True)
    uvicorn.Server(uvicorn.Config(app, log_level="warning")).run(sockets=[listener])


if __name__ == "__main__":
    main()
