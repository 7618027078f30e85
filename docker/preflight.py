"""The preflight of a deployment (`init` in the image): the checks a service would fail at start, made once
before any service starts, so that a bad path or setting stops `docker compose up` (or a Kubernetes pod's init
container) with its cause instead of sending a service into a restart loop.

    python docker/preflight.py --target DIR --drafter DIR|ngram [--tensor-parallel N]

Checked: the target is a checkpoint the verifier can load (config.json of a served architecture, weights,
tokenizer.json for the gateway), the tensor-parallel degree fits it, the drafter is `ngram` or a DFlash
checkpoint that fits the target, and the certificate files the services read (DDTREE_INTERNAL_*, DDTREE_TLS_*)
are usable. Every problem is one line on stderr, naming the setting; exit 1 on any.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from modeling.config import ModelConfig
from modeling.dflash import DFlashConfig
from modeling.tensor_parallel import plan_shards
from proto.security import GATEWAY_TLS_ENV, INTERNAL_ENV, Tls
from proto.serving import describe


def _weights(path: str) -> list[str]:
    return [] if any(Path(path).glob("*.safetensors")) else [f"{path}: no *.safetensors weights"]


def target_problems(target: str) -> tuple[ModelConfig | None, list[str]]:
    try:
        config = ModelConfig.from_dir(target)
    except Exception as error:  # noqa: BLE001 - reported, whatever it is
        return None, [describe(error)]
    problems = _weights(target)
    if not (Path(target) / "tokenizer.json").is_file():
        problems.append(f"{target}/tokenizer.json not found (the gateway tokenizes with it)")
    return config, problems


def tensor_parallel_problems(tensor_parallel: int, target: ModelConfig | None) -> list[str]:
    try:
        if target is not None:
            plan_shards(target, tensor_parallel)
    except ValueError as error:
        return [describe(error)]
    return []


def drafter_problems(drafter: str, target: ModelConfig | None) -> list[str]:
    if drafter == "ngram":
        return []
    try:
        config = DFlashConfig.from_dir(drafter)
    except Exception as error:  # noqa: BLE001 - reported, whatever it is
        return [describe(error)]
    problems = _weights(drafter)
    if target is not None and config.model.hidden_size != target.hidden_size:
        problems.append(f"hidden size {config.model.hidden_size} differs from the target's {target.hidden_size}: "
                        "a DFlash drafter reads the target's hidden states")
    return problems


def tls_problems() -> list[str]:
    """The certificate, key and CA of each set the environment names, loaded as a server would load them."""
    problems = []
    for names in (INTERNAL_ENV, GATEWAY_TLS_ENV):
        cert, key, ca = (os.environ.get(names[name]) or None for name in ("cert", "key", "ca"))
        if cert or key or ca:
            try:
                Tls(cert, key, ca).server_credentials()
            except ValueError as error:
                problems.append(f"{names['cert']}, {names['key']}, {names['ca']}: {error}")
    return problems


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="preflight", description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", required=True)
    parser.add_argument("--drafter", required=True, help="a DFlash checkpoint directory or 'ngram'")
    parser.add_argument("--tensor-parallel", type=int, default=int(os.environ.get("DDTREE_TENSOR_PARALLEL", "1")),
                        help="the verifier's degree (default: $DDTREE_TENSOR_PARALLEL or 1)")
    args = parser.parse_args(argv)
    target, target_issues = target_problems(args.target)
    problems = [f"DDTREE_TARGET={args.target}: {p}" for p in target_issues]
    problems += [f"DDTREE_TENSOR_PARALLEL={args.tensor_parallel}: {p}"
                 for p in tensor_parallel_problems(args.tensor_parallel, target)]
    problems += [f"DDTREE_DRAFTER={args.drafter}: {p}" for p in drafter_problems(args.drafter, target)]
    problems += tls_problems()
    for problem in problems:
        print(f"preflight: error: {problem}", file=sys.stderr)
    if problems:
        return 1
    print(f"preflight: ok: target {args.target} ({target.architecture}, tensor parallel {args.tensor_parallel}), "
          f"drafter {args.drafter}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
