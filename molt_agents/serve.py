"""`molt-serve`: an engine and the loopback, standalone.

Debug an existing agent against the policy, or collect trajectories without
training. Sessions are created on first use: point a client at
`http://127.0.0.1:PORT/s/<any-name>/v1`, then `POST /s/<name>/finish` with
`{"reward": r}`; each finished session's segments are appended to
`--trajectories` as JSON lines.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="molt-serve", description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="model directory (default: the built-in tiny model)")
    parser.add_argument("--lora", type=Path, default=None,
                        help="a LoRA adapter directory in PEFT's format (a LoRA run's checkpoint adapter/) to serve "
                             "on --model (default: the adapter's own base model); needs --engine vllm")
    parser.add_argument("--engine", default="vllm", help="engine backend (default: vllm)")
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default: 127.0.0.1)")
    parser.add_argument("--port", type=int, default=0, help="port (default: a free one)")
    parser.add_argument("--api-key", default=None, help="API key clients must send (default: a fresh random key)")
    parser.add_argument("--trajectories", type=Path, default=None, help="append finished sessions here (JSON lines)")
    parser.add_argument("--max-model-len", type=int, default=4096, help="context window in tokens")
    parser.add_argument("--dtype", default="float32", help="engine weight dtype")
    parser.add_argument("--allow-remote-images", action="store_true",
                        help="fetch http(s) image URLs (default: only inline data: URLs are accepted)")
    args = parser.parse_args(argv)

    from transformers import AutoTokenizer

    from molt_agents.engines import make_engine
    from molt_agents.loopback import Loopback
    from molt_agents.multimodal import ImageLimits, Vision
    from molt_agents.tiny import model_dir

    from molt_agents.hf_model import adapter_base

    try:
        if args.lora is not None and args.engine != "vllm":
            raise ValueError(f"--lora: served by vLLM's LoRA, not --engine {args.engine}")
        base = args.model if args.model or args.lora is None else adapter_base(args.lora)
        model = str(model_dir(base, default="dense"))
    except ValueError as error:
        parser.exit(2, f"molt-serve: {error}\n")
    tokenizer = AutoTokenizer.from_pretrained(model)
    engine = make_engine(args.engine, model, dtype=args.dtype, max_model_len=args.max_model_len,
                         **({"adapter": str(args.lora)} if args.lora else {}))

    def write(trajectories):
        if args.trajectories is None:
            return
        with args.trajectories.open("a") as out:
            for trajectory in trajectories:
                out.write(json.dumps({"session": trajectory.info.get("session"), **trajectory.to_dict()}) + "\n")

    loopback = Loopback(engine, tokenizer, model_name=Path(model).name, host=args.host, port=args.port,
                        api_key=args.api_key, max_model_len=args.max_model_len, auto_sessions=True, keep_messages=True,
                        on_finish=write, vision=Vision(model) if Vision.available(model) else None,
                        image_limits=ImageLimits(allow_remote=args.allow_remote_images))
    loopback.start()
    print(f"molt-serve: model {model}" + (f" with the LoRA adapter {args.lora}" if args.lora else ""), flush=True)
    print(f"base URL: {loopback.base_url('<session>')}", flush=True)
    print(f"API key: {loopback.api_key}", flush=True)
    print(f"finish a session: POST http://{args.host}:{loopback.port}/s/<session>/finish {{\"reward\": 1.0}}",
          flush=True)
    try:
        loopback._thread.join()
    except KeyboardInterrupt:
        pass
    finally:
        loopback.stop()
        engine.close()


if __name__ == "__main__":
    main()
