"""The verifier's messages to and from a drafter replica: requests built field by field (a nested constructor copies
the inner message, once more into a batch; a 42 MB seed four times), each with its size for the batching."""

from __future__ import annotations

from typing import NamedTuple

import torch

from modeling.speculation import DrafterSeed, DraftStep
from modeling.tree import DraftTree
from proto import common_pb2, drafter_pb2
from proto.tensors import fill_proto


class Outgoing(NamedTuple):
    """A request for a replica's stream and its size in bytes (what a batch message counts against BATCH_BYTES)."""

    request: drafter_pb2.DrafterRequest
    size: int


def sized(request: drafter_pb2.DrafterRequest, features: torch.Tensor | None = None,
          field: common_pb2.Tensor | None = None) -> Outgoing:
    """The request, with `features` written into its `field` where given, and its size: measured before the
    features go in, then their bytes added (upb's ByteSize encodes the whole message: ~30 ms for a 42 MB seed)."""
    size = request.ByteSize()
    if features is not None and field is not None:
        fill_proto(field, features)
        size += features.numel() * features.element_size() + 32  # NOTE: the Tensor's tags, dtype and shape
    return Outgoing(request, size)


def batch_request(requests: list[drafter_pb2.DrafterRequest]) -> drafter_pb2.DrafterRequest:
    message = drafter_pb2.DrafterRequest()
    message.batch.requests.extend(requests)  # NOTE: one copy; nested constructors would copy twice
    return message


def step_request(step: DraftStep) -> Outgoing:
    """Set field by field: a nested constructor copies the inner message. No features (n-gram) leave the field
    unset, which a drafter reads as empty."""
    request = drafter_pb2.DrafterRequest()
    message = request.step
    message.session_id, message.step, message.root_token_id, message.position, message.tree_budget = (
        step.session_id, step.step, step.root, step.position, step.budget)
    message.committed_token_ids.extend(step.committed)
    return sized(request, step.features, message.features)


def open_request(session_id: str, seed: DrafterSeed, acknowledge: bool = False) -> Outgoing:
    """A mirror's seed, set field by field as a step is (its features are the W latest tokens': 42 MB for a
    Qwen3-8B-shaped DFlash drafter)."""
    request = drafter_pb2.DrafterRequest()
    message = request.open
    message.session_id, message.start_position, message.acknowledge = session_id, seed.start_position, acknowledge
    message.token_ids.extend(seed.tokens)
    return sized(request, seed.features, message.features)


def close_request(session_id: str) -> Outgoing:
    return sized(drafter_pb2.DrafterRequest(close=drafter_pb2.DrafterClose(session_id=session_id)))


def tree_from_reply(tree: common_pb2.DraftTree) -> DraftTree:
    # NOTE: a slice turns a repeated field into a list in one call, which tuple() then copies at C speed
    return DraftTree(tuple(tree.tokens[:]), tuple(tree.parents[:]), tuple(tree.depths[:]), tuple(tree.logprobs[:]))

