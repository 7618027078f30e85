"""The verifier over N tensor-parallel ranks, one process each (NCCL on GPUs, gloo on the CPU).

Rank 0 is the engine: sessions, pages, sampling, acceptance, and gRPC. Each operation that touches the model
or the KV tensors (a forward, the LM head, a commit, a copy-on-write page copy) is sent to the followers as a
small command, then run on rank 0; the followers run the same operation on their shard (their own KV heads,
or for MLA the whole latent entries, at the same page numbers), and the collectives inside it keep the ranks in
step. Hidden states are replicated after every all-reduce, so the drafter's features are read on rank 0 and
never gathered.

Commands travel over one pipe per follower, not a broadcast: an idle follower then waits in a pipe read,
which has no timeout and ends (EOF) when rank 0 dies, where a broadcast would time out while the service is
idle.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import multiprocessing
import os
import pickle
from collections.abc import Callable
from dataclasses import dataclass, replace
from datetime import timedelta
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from typing import TypeVar

import torch
import torch.distributed as dist

from modeling.tensor_parallel import TensorParallelCausalLM, kv_share, load_shard, plan_shards, weight_share
from modeling.tokenizer import Tokenizer
from verifier_service.engine.config import EngineConfig
from verifier_service.engine.engine import Engine, checkpoint_tokenizer
from verifier_service.engine.kv_cache import KVCache
from verifier_service.engine.verify_batch import BlockSpec
from verifier_service.errors import EngineDown

T = TypeVar("T")

# ---- commands: what rank 0 sends and every rank runs ----------------------------------------------------------


@dataclass(frozen=True)
class Forward:
    blocks: tuple[BlockSpec, ...]


@dataclass(frozen=True)
class ForwardNext:
    """A decode burst's next forward: the rows' tokens are the last Head's greedy tokens, which every rank holds."""

    blocks: tuple[BlockSpec, ...]


@dataclass(frozen=True)
class Head:
    """The LM head over the last forward's hidden states."""

    greedy: bool


@dataclass(frozen=True)
class Logits:
    """The whole vocab's logits of some rows of the last forward (a greedy batch's sessions that ask for logprobs):
    a gather every rank joins."""

    spans: tuple[tuple[int, int], ...]


@dataclass(frozen=True)
class Commit:
    src_rows: list[int]
    dst_slots: list[int]


@dataclass(frozen=True)
class CopyPages:
    src: list[int]
    dst: list[int]


@dataclass(frozen=True)
class Stop:
    pass


Command = Forward | ForwardNext | Head | Logits | Commit | CopyPages | Stop


class Follower:
    """A rank > 0: an engine without sessions of its own, running rank 0's commands on its shard."""

    def __init__(self, engine: Engine):
        self.engine = engine
        self.hidden: torch.Tensor | None = None
        self.tokens: torch.Tensor | None = None  # the last greedy Head's tokens

    def run(self, command: Command) -> None:
        match command:
            case Forward(blocks):
                self.hidden, _ = self.engine.forward(list(blocks))
            case ForwardNext(blocks):
                self.hidden, _ = self.engine.forward(list(blocks), self.tokens)
            case Head(greedy):
                chosen = self.engine.head(self.hidden, greedy)
                self.tokens = chosen if greedy else None
            case Logits(spans):
                self.engine.logits(self.hidden, list(spans))
            case Commit(src_rows, dst_slots):
                self.engine.commit(src_rows, dst_slots)
            case CopyPages(src, dst):
                self.engine.kv.copy_pages(src, dst)


# ---- rank 0 ------------------------------------------------------------------------------------------------------


class Followers:
    """Rank 0's handles on ranks 1..N-1: their processes and the pipes their commands go down."""

    def __init__(self, processes: list[BaseProcess], pipes: list[Connection]):
        self.processes, self.pipes = processes, pipes

    def send(self, command: Command) -> None:
        data = pickle.dumps(command)
        for pipe in self.pipes:
            pipe.send_bytes(data)

    def failure(self) -> str | None:
        """Why the group is broken, when a follower has exited."""
        for rank, process in enumerate(self.processes, start=1):
            if process.exitcode is not None:
                return f"tensor-parallel rank {rank} exited with code {process.exitcode}"
        return None

    def stop(self, timeout_s: float = 10.0) -> None:
        """Ask every follower to leave, then kill those that do not."""
        try:
            self.send(Stop())
        except OSError:
            pass  # NOTE: a follower already gone; kill() below takes care of the rest
        for process in self.processes:
            process.join(timeout_s)
        self.kill()

    def kill(self) -> None:
        for process in self.processes:
            if process.exitcode is None:
                process.kill()
            process.join()


class LeaderKVCache(KVCache):
    """Rank 0's pages: a copy-on-write copy happens on every rank."""

    def __init__(self, mirrored: Callable[[Command, Callable[[], None]], None], *args):
        super().__init__(*args)
        self.mirrored = mirrored

    def copy_pages(self, src: list[int], dst: list[int]) -> None:
        self.mirrored(CopyPages(src, dst), functools.partial(super().copy_pages, src, dst))


class LeaderEngine(Engine):
    """Rank 0's engine: each model/KV operation goes to the followers, then runs here. After a failure of any
    of them the ranks may be out of step, so the engine refuses all later work (EngineDown)."""

    def __init__(self, model: TensorParallelCausalLM, config: EngineConfig, tokenizer: Tokenizer | None,
                 followers: Followers):
        self.followers = followers
        self.down: str | None = None
        super().__init__(model, config, tokenizer)

    def _kv_cache(self, num_pages: int, dtype: torch.dtype, device: torch.device) -> KVCache:
        return LeaderKVCache(self._mirrored, self.model.shard_config, num_pages, self.config.page_size, dtype, device)

    def forward(self, blocks: list[BlockSpec], input_ids: torch.Tensor | None = None
                ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """`input_ids` only within a decode burst: the last Head's greedy tokens, which the followers hold too."""
        command = Forward(tuple(blocks)) if input_ids is None else ForwardNext(tuple(blocks))
        return self._mirrored(command, functools.partial(super().forward, blocks, input_ids))

    def burst_length(self, session_ids: list[str], wanted: int) -> int:
        """One step unless every session decodes by the raw argmax: a sampled token, or one chosen from penalized
        or biased logits, is chosen on this rank alone, so the followers could not feed it to the next step."""
        if not all(self.session(sid).generation.params.raw_argmax for sid in session_ids
                   if self.session(sid).generation is not None):
            return 1
        return super().burst_length(session_ids, wanted)

    def head(self, hidden: torch.Tensor, greedy: bool) -> torch.Tensor:
        return self._mirrored(Head(greedy), functools.partial(super().head, hidden, greedy))

    def logits(self, hidden: torch.Tensor, spans: list[tuple[int, int]]) -> torch.Tensor:
        return self._mirrored(Logits(tuple(spans)), functools.partial(super().logits, hidden, spans))

    def commit(self, src_rows: list[int], dst_slots: list[int]) -> torch.Tensor:
        return self._mirrored(Commit(src_rows, dst_slots), functools.partial(super().commit, src_rows, dst_slots))

    def _mirrored(self, command: Command, run: Callable[[], T]) -> T:
        if self.down:
            raise EngineDown(self.down)
        try:
            self.followers.send(command)
            return run()
        except Exception as error:
            self.down = f"tensor-parallel {type(command).__name__} failed: {error}"
            raise EngineDown(self.down) from error


# ---- joining the group -----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class GroupSetup:
    """What every rank needs to load its shard and join the process group."""

    target: str
    world_size: int
    engine: EngineConfig
    store_port: int  # rank 0's TCPStore (rendezvous)
    timeout_s: float  # collectives: a dead peer fails them at once on gloo, a stuck one after this

    def engine_config(self, rank: int) -> EngineConfig:
        """cuda:<rank> for rank <rank> when the engine runs on CUDA, else the CPU. Ranks run eagerly: a graph
        per rank would have to capture the same buckets in the same order as its peers' collectives."""
        if torch.device(self.engine.device).type == "cuda":
            return replace(self.engine, device=f"cuda:{rank}", cuda_graphs=False)
        return self.engine


def _join(setup: GroupSetup, rank: int, store: dist.Store) -> tuple[TensorParallelCausalLM, EngineConfig]:
    config = setup.engine_config(rank)
    on_cuda = torch.device(config.device).type == "cuda"
    if on_cuda:
        torch.cuda.set_device(config.device)
    else:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // setup.world_size))  # NOTE: ranks share the cores
    model = load_shard(setup.target, setup.world_size, rank, config.torch_dtype, config.device)
    dist.init_process_group("nccl" if on_cuda else "gloo", store=store, rank=rank, world_size=setup.world_size,
                            timeout=timedelta(seconds=setup.timeout_s))
    return model, config


def follower_main(setup: GroupSetup, rank: int, commands: Connection) -> None:
    """A follower process: join, then run commands until Stop, or until rank 0 is gone (EOF)."""
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s verifier rank {rank} %(levelname)s %(message)s")
    store = dist.TCPStore("127.0.0.1", setup.store_port, setup.world_size, is_master=False,
                          timeout=timedelta(seconds=setup.timeout_s))
    model, config = _join(setup, rank, store)
    follower = Follower(Engine(model, config))
    try:
        while True:
            try:
                command = pickle.loads(commands.recv_bytes())
            except EOFError:
                logging.warning("rank 0 is gone: leaving")
                return
            if isinstance(command, Stop):
                return
            follower.run(command)
    finally:
        dist.destroy_process_group()


class TensorParallelGroup:
    """Rank 0's side of the group: starts the followers, builds the leader engine, tells when a rank failed."""

    def __init__(self, engine: LeaderEngine, followers: Followers):
        self.engine, self.followers = engine, followers

    @staticmethod
    def start(target: str, config: EngineConfig, world_size: int, timeout_s: float = 120.0) -> TensorParallelGroup:
        store = dist.TCPStore("127.0.0.1", 0, world_size, is_master=True, timeout=timedelta(seconds=timeout_s),
                              wait_for_workers=False)
        setup = GroupSetup(target, world_size, config, store.port, timeout_s)
        # NOTE: followers fork from a clean server process (no threads, no CUDA) that imported torch and this
        # module once; building a model on the meta device imports torch._dynamo, a few seconds of CPU, so once too.
        context = multiprocessing.get_context("forkserver")
        context.set_forkserver_preload([__name__, "torch._dynamo"])
        processes, pipes = [], []
        for rank in range(1, world_size):
            receive, send = context.Pipe(duplex=False)
            process = context.Process(target=follower_main, args=(setup, rank, receive), daemon=True,
                                      name=f"verifier-rank-{rank}")
            process.start()
            receive.close()
            processes.append(process)
            pipes.append(send)
        followers = Followers(processes, pipes)
        try:
            model, rank_config = _join(setup, 0, store)
        except BaseException:
            followers.kill()
            raise
        log_balance(model)
        return TensorParallelGroup(LeaderEngine(model, rank_config, checkpoint_tokenizer(target), followers),
                                   followers)

    async def wait_for_failure(self, poll_s: float = 0.1) -> str:
        """Returns why, once a follower has exited or an operation has failed on rank 0."""
        while (reason := self.engine.down or self.followers.failure()) is None:
            await asyncio.sleep(poll_s)
        return reason

    def abort(self) -> None:
        """After a failure: the surviving followers are of no use; killing them also ends, with an error, a
        gloo collective rank 0 may still be waiting in."""
        self.followers.kill()

    def stop(self) -> None:
        if self.engine.down or self.followers.failure():
            self.abort()
            return
        self.followers.stop()
        dist.destroy_process_group()


def log_balance(model: TensorParallelCausalLM) -> None:
    """The cost of uneven shards: the busiest rank's share of the weights and KV against 1/N (an MLA rank holds
    the whole latent cache)."""
    config, world_size = model.config, model.shard.world_size
    shards = plan_shards(config, world_size)
    weights = max(weight_share(config, s) for s in shards)
    kv = max(kv_share(config, s) for s in shards)
    logging.info("tensor parallel over %d ranks: the busiest rank holds %.1f%% of the weights and %.1f%% of the "
                 "KV (even: %.1f%%)", world_size, 100 * weights, 100 * kv, 100 / world_size)
