"""RayDistributedExecutor: the ranks as Ray actors, on one node or many (vLLM's "ray" backend).

    ray start --head --port=6379                 # node 0
    ray start --address=<node0-ip>:6379          # node 1, ...
    pagedllm serve MODEL --tensor-parallel-size 4 --pipeline-parallel-size 2 \
        --distributed-executor-backend ray --ray-address auto

`ray_address` is passed to `ray.init` ("auto": the cluster this node belongs to; "host:port"); with
none and no Ray running, `ray.init()` starts a local cluster for this engine (and stops it at
shutdown). One placement-group bundle per rank ({"GPU": 1} on CUDA, {"CPU": 1} on the CPU), packed
onto as few nodes as fit, so the ranks of a TP group share a node when they can; rank r is the
actor in bundle r. The ranks talk through torch.distributed (NCCL / gloo), rank 0's node hosting
the rendezvous.

Per step the SchedulerOutput is encoded once (msgpack) and put into Ray's object store once; every
actor reads that one object. The output rank returns the encoded ModelRunnerOutput. An actor that
dies or a step that does not finish within PAGEDLLM_EXECUTE_MODEL_TIMEOUT_S kills every actor
and raises: the engine fails, it does not hang.
"""

from __future__ import annotations

import logging
import os
import socket
import sys
import weakref
from pathlib import Path
from typing import Any

import pagedllm
from pagedllm.core.sched_output import ModelRunnerOutput
from pagedllm.executor.distributed import (
    STARTUP_TIMEOUT_S,
    DistributedExecutorBase,
    WorkerDiedError,
    execute_model_timeout_s,
)
from pagedllm.executor.rank_worker import RankWorker, decode_output

logger = logging.getLogger(__name__)


def _kill_actors(actors: list[Any], pg: Any) -> None:
    import ray

    if not ray.is_initialized():
        return
    for actor in actors:
        try:
            ray.kill(actor)
        except Exception:  # noqa: BLE001 - already gone
            pass
    try:
        ray.util.remove_placement_group(pg)
    except Exception:  # noqa: BLE001 - the cluster may be gone
        pass


class RayRankActor:
    """The body of one rank's actor (wrapped with ray.remote by the executor)."""

    def __init__(self) -> None:
        self.rank_worker: RankWorker | None = None

    def node_and_port(self) -> tuple[str, str, int]:
        """(Ray node id, this node's IP, a free TCP port here) for rank layout and the rendezvous."""
        import ray

        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind(("", 0))
            port = s.getsockname()[1]
        return ray.get_runtime_context().get_node_id(), ray.util.get_node_ip_address(), port

    def start(self, config: Any, rank: int, local_rank: int, init_method: str, ranks_on_node: int) -> None:
        logging.basicConfig(level=logging.INFO,
                            format=f"%(asctime)s %(levelname)s [rank {rank}] %(name)s: %(message)s")
        self.rank_worker = RankWorker(config, rank, local_rank, init_method, ranks_on_node)

    def call(self, method: str, args: list[Any]) -> Any:
        assert self.rank_worker is not None
        return self.rank_worker.call(method, args)

    def execute(self, step: bytes) -> bytes | None:
        assert self.rank_worker is not None
        return self.rank_worker.execute(step)

    def sample(self, grammar: bytes) -> bytes | None:
        assert self.rank_worker is not None
        return self.rank_worker.sample(grammar)

    def shutdown(self) -> None:
        if self.rank_worker is not None:
            self.rank_worker.shutdown()


class _RayStepHandle:
    """A launched step: every actor's result of it (the output rank's is the output); `before`:
    the deferred step's own calls, awaited with it (a constrained step: execute, then sample)."""

    def __init__(self, executor: RayDistributedExecutor, refs: list[Any], before: list[Any] | None = None) -> None:
        self._executor = executor
        self._refs = refs
        self._before = before or []
        self._output: ModelRunnerOutput | None = None

    def get(self) -> ModelRunnerOutput:
        if self._output is None:
            results = self._executor._get(self._before + self._refs, execute_model_timeout_s(), "execute_model")
            self._output = decode_output(results[len(self._before) + self._executor.output_rank])
        return self._output


class RayDistributedExecutor(DistributedExecutorBase):
    def _init_executor(self) -> None:
        import ray
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        self._init_ranks()
        pc = self.config.parallel_config
        self._deferred_refs: list[Any] = []  # a constrained step's execute calls, until sample_tokens
        self._owns_ray = not ray.is_initialized()
        if self._owns_ray:
            ray.init(address=pc.ray_address)
        on_gpu = self.config.device_config.device == "cuda"
        bundle = {"GPU": 1, "CPU": 1} if on_gpu else {"CPU": 1}
        self._pg = ray.util.placement_group([dict(bundle) for _ in range(self.world_size)], strategy="PACK")
        try:
            ray.get(self._pg.ready(), timeout=STARTUP_TIMEOUT_S)
        except ray.exceptions.GetTimeoutError:
            ray.util.remove_placement_group(self._pg)
            raise RuntimeError(
                f"the Ray cluster cannot place {self.world_size} ranks of {bundle} each within "
                f"{STARTUP_TIMEOUT_S:.0f} s; available: {ray.available_resources()}"
            ) from None
        root = str(Path(pagedllm.__file__).resolve().parent.parent)
        # Ray's env_vars replace the variable: this process's whole import path goes along.
        env = {"PYTHONPATH": os.pathsep.join(dict.fromkeys(p for p in (root, *sys.path) if p))}
        actor_cls = ray.remote(RayRankActor)
        self.actors = [
            actor_cls.options(
                num_cpus=1, num_gpus=1 if on_gpu else 0, runtime_env={"env_vars": env},
                scheduling_strategy=PlacementGroupSchedulingStrategy(self._pg, placement_group_bundle_index=i),
            ).remote()
            for i in range(self.world_size)
        ]
        placed = self._get([a.node_and_port.remote() for a in self.actors], STARTUP_TIMEOUT_S, "start")
        nodes = [node for node, _, _ in placed]
        _, ip0, port0 = placed[0]
        init_method = f"tcp://{ip0}:{port0}"
        starts = []
        for rank, actor in enumerate(self.actors):
            # Ray shows each GPU actor only its own GPU (CUDA_VISIBLE_DEVICES): it is device 0 there.
            local_rank = 0 if on_gpu else nodes[:rank].count(nodes[rank])
            starts.append(actor.start.remote(self.config, rank, local_rank, init_method, nodes.count(nodes[rank])))
        self._get(starts, STARTUP_TIMEOUT_S, "start")
        # Dropped without shutdown (`del llm`): the actors and their placement group go too.
        self._finalizer = weakref.finalize(self, _kill_actors, list(self.actors), self._pg)
        logger.info("Ray executor: %d ranks on %d node(s), rendezvous %s", self.world_size, len(set(nodes)),
                    init_method)
        self.collective_rpc("init_device")
        self.collective_rpc("load_model")

    def _get(self, refs: list[Any], timeout: float, what: str) -> list[Any]:
        import ray

        self._raise_if_dead()
        try:
            return ray.get(refs, timeout=timeout)
        except ray.exceptions.GetTimeoutError:
            self._fail(f"the ranks did not finish {what} within {timeout:.0f} s (a rank is hung?)")
        except ray.exceptions.RayActorError as e:
            self._fail(f"a rank's actor died during {what}: {e}")
        except ray.exceptions.RayTaskError as e:
            self._fail(f"a rank failed in {what}: {e}")
        raise AssertionError("unreachable")

    def _fail(self, why: str) -> None:
        self._dead = why
        logger.error("Ray executor failed: %s; stopping every rank", why)
        self._stop_actors()
        raise WorkerDiedError(why)

    def collective_rpc(self, method: str, *args: Any, timeout: float = STARTUP_TIMEOUT_S) -> list[Any]:
        return self._get([a.call.remote(method, list(args)) for a in self.actors], timeout, method)

    def _send(self, kind: str, payload: bytes, answered: bool) -> _RayStepHandle | None:
        """One object in Ray's store, read by every actor; an actor runs its calls in submission
        order, so the next step may be submitted at once."""
        import ray

        obj = ray.put(payload)
        refs = [(a.execute if kind == "step" else a.sample).remote(obj) for a in self.actors]
        if not answered:
            self._deferred_refs = refs  # a constrained step: its errors surface with its sample's
            return None
        before, self._deferred_refs = self._deferred_refs, []
        return _RayStepHandle(self, refs, before)

    def check_health(self) -> None:
        self.collective_rpc("check_health", timeout=60.0)

    def _stop_actors(self) -> None:
        finalizer = getattr(self, "_finalizer", None)
        if finalizer is not None:
            finalizer.detach()
        _kill_actors(getattr(self, "actors", []), getattr(self, "_pg", None))
        self.actors = []
        self._pg = None

    def shutdown(self) -> None:
        import ray

        if getattr(self, "actors", None):
            if self._dead is None:
                try:
                    ray.get([a.shutdown.remote() for a in self.actors], timeout=10.0)
                except Exception:  # noqa: BLE001 - stopping anyway
                    pass
            self._dead = self._dead or "shut down"
            self._stop_actors()
        if self._owns_ray and ray.is_initialized():
            ray.shutdown()
            self._owns_ray = False
