"""``WorkerGroup``: the ranks of one role as Ray actors on a resource pool, called with plain methods.

The group spawns one Ray actor per rank of a :class:`~megarl.workers.base.Worker` subclass,
rank r on bundle ``bundles[r]`` of a :class:`~megarl.plan.placement.ResourcePool`,
each with ``num_gpus`` of its bundle's GPU (colocated roles share a bundle: give each
``1/k``). It then sets every rank's distributed environment: rank 0 reports its node IP and
a free port, and the group passes them, with RANK / WORLD_SIZE / LOCAL_RANK, to all ranks
(``OMP_NUM_THREADS=1`` is in every actor's runtime env).

Calls take the worker method itself, not its name, so that go-to-definition works and a
typo fails where it is written (no dispatch decorators; the caller says how to dispatch)::

    wg = WorkerGroup(ActorWorker, pool, role="actor")
    wg.call_all(ActorWorker.init_model, model_path=..., parallel=...)
    wg.call_dp(ActorWorker.update_actor, batch, temperature=1.0)
    names = wg.call_rank(0, ActorWorker.weight_names)
    urls = rollout_wg.call_ranks([((), {...}) for _ in ranks], EngineServerWorker.start_server)

- :meth:`call_all` — the same arguments to every rank, the results in rank order;
- :meth:`call_rank` — one rank;
- :meth:`call_ranks` — every rank with its own ``(args, kwargs)``, the results in rank order;
- :meth:`call_dp` — split a :class:`~megarl.data.Batch` by data-parallel rank
  (:meth:`split_by_dp`: chunk d goes to every TP/PP/CP rank of DP replica d), then collect
  one output per replica (:meth:`gather_by_dp`: from TP rank 0, CP rank 0, last pipeline
  stage) and concatenate them in DP order.

Before submitting anything a call checks that the function is a method of the group's
worker class — defined on it or inherited (``Worker.ping``, ``_MegatronWorker.offload``) —
by identity in the class's MRO; a function of another class (``CriticWorker.init_model``
on the actor group) or a method name as a string raises ``TypeError`` naming the role and
listing the class's public methods. Each rank then runs ``getattr(actor, fn.__name__)``,
so a subclass's override runs as in an ordinary Python call on the instance.

The DP/TP/PP coordinates come from the ranks (:meth:`refresh_coordinates` calls
``Worker.coordinates`` on every rank after they initialised their parallel groups).

Failures: every wait has a timeout, and a call returns as soon as any rank fails — a dead
actor (killed, OOM, node lost) ends the call within Ray's failure detection (about a
second) with a :class:`WorkerError` naming the role, rank and method, while the survivors
may still be blocked in a collective; :meth:`shutdown` kills them.
"""

from __future__ import annotations

import contextlib
import difflib
import inspect
import os
import tempfile
import time
import uuid
from collections import defaultdict
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

from megarl.config.parallel import Coordinates
from megarl.data import Batch
from megarl.errors import FieldsError
from megarl.parallel.net import node_ip
from megarl.parallel.reaper import RENDEZVOUS_PREFIX, RUN_ID_VARIABLE
from megarl.workers.base import Worker

R = TypeVar("R")


class WorkerError(FieldsError, RuntimeError):
    """A rank of a worker group failed, died or timed out; the message names role, rank and method."""

    def __init__(self, message: str, *, role: str, rank: int | None, method: str):
        super().__init__(message)
        self.role, self.rank, self.method = role, rank, method


def _class_attribute(cls: type, name: str, fn: Any) -> bool:
    """Whether some class of ``cls``'s MRO (``object`` aside) holds ``fn`` itself as its attribute ``name``."""
    for klass in cls.__mro__[:-1]:
        attr = vars(klass).get(name)
        if isinstance(attr, (staticmethod, classmethod)):
            attr = attr.__func__
        if attr is not None and (attr is fn or attr is getattr(fn, "__func__", None)):
            return True
    return False


def public_methods(cls: type) -> list[str]:
    """The names of ``cls``'s public methods, its own and inherited (``object``'s aside), sorted."""
    names = set()
    for klass in cls.__mro__[:-1]:
        for name, attr in vars(klass).items():
            if not name.startswith("_") and (inspect.isfunction(attr) or isinstance(attr, (staticmethod, classmethod))):
                names.add(name)
    return sorted(names)


class WorkerGroup:
    """``world_size`` Ray actors of ``worker_cls`` on ``pool``; rank r on bundle ``bundles[r]``.

    ``args``/``kwargs`` go to every rank's constructor. ``num_gpus``/``num_cpus`` are each
    rank's share of its bundle (``None``: the whole bundle's GPU when the pool has GPUs, and
    ``pool.cpus_per_bundle`` CPUs divided the same way). ``env`` adds environment variables
    to every rank. ``timeout_s`` bounds every call unless a call gives its own, and the ranks' start
    (``start_timeout_s``, None: the same; starting a rank imports torch and Megatron, minutes on a loaded
    machine). ``timeout_setting`` is the setting a late rank's error names (default: "the timeout").

    Every call takes a method of ``worker_cls`` (``ActorWorker.update_actor``, inherited ones
    such as ``Worker.ping`` included), never its name; anything else raises ``TypeError``
    before a rank is called.
    """

    def __init__(
        self,
        worker_cls: type[Worker],
        pool,
        *,
        role: str | None = None,
        args: Sequence[Any] = (),
        kwargs: dict[str, Any] | None = None,
        bundles: Sequence[int] | None = None,
        num_gpus: float | None = None,
        num_cpus: float | None = None,
        env: dict[str, str] | None = None,
        timeout_s: float = 600.0,
        start_timeout_s: float | None = None,
        timeout_setting: str | None = None,
    ):
        import ray

        if not issubclass(worker_cls, Worker):
            raise TypeError(f"WorkerGroup needs a megarl.workers.base.Worker subclass, got {worker_cls!r}")
        self.worker_cls = worker_cls
        self.role = role or worker_cls.role
        self.pool = pool
        self.bundles = tuple(range(pool.size)) if bundles is None else tuple(bundles)
        if not self.bundles:
            raise ValueError(f"{self.role}: a worker group needs at least one bundle")
        self.timeout_s, self.timeout_setting = timeout_s, timeout_setting
        gpu_share = (1.0 if pool.use_gpu else 0.0) if num_gpus is None else num_gpus
        if gpu_share and not pool.use_gpu:
            raise ValueError(f"{self.role}: num_gpus={gpu_share} on pool {pool.name!r} which has CPU-only bundles")
        cpu_share = pool.cpus_per_bundle * (gpu_share or 1.0) if num_cpus is None else num_cpus
        env_vars = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", **worker_cls.env_vars, **(env or {})}
        remote_cls = ray.remote(worker_cls)
        self._actors = []
        try:
            for rank, bundle in enumerate(self.bundles):
                options = dict(num_cpus=cpu_share, num_gpus=gpu_share,
                               scheduling_strategy=pool.scheduling_strategy(bundle),
                               runtime_env={"env_vars": env_vars}, max_restarts=0, max_task_retries=0)
                self._actors.append(remote_cls.options(**options).remote(*args, **(kwargs or {})))
            self._setup_env(timeout_s if start_timeout_s is None else start_timeout_s)
        except BaseException:
            self.shutdown()
            raise
        self._coordinates: list[Coordinates] | None = None

    # ------------------------------------------------------------------------- set-up

    def _setup_env(self, timeout_s: float) -> None:
        infos = self.call_all(Worker.node_info, timeout_s=timeout_s)
        master_addr, master_port = self.call_rank(0, Worker.rendezvous_address, timeout_s=timeout_s)
        by_node: dict[str, list[int]] = defaultdict(list)
        for rank, info in enumerate(infos):
            by_node[info["ip"]].append(rank)
        # Ranks all on this (the driver's) machine meet through a file, which shutdown removes: a TCP store would
        # listen on every interface whatever its address.
        rendezvous_file = None
        if set(by_node) == {node_ip()}:
            # named by the run (the reaper removes a killed driver's)
            run = f"{os.environ[RUN_ID_VARIABLE]}_" if os.environ.get(RUN_ID_VARIABLE) else ""
            rendezvous_file = os.path.join(tempfile.gettempdir(), f"{RENDEZVOUS_PREFIX}{run}{uuid.uuid4().hex}")
        self.rendezvous_file = rendezvous_file
        per_rank = []
        for rank, info in enumerate(infos):
            peers = by_node[info["ip"]]
            visible = None
            if all(infos[p]["gpu_ids"] for p in peers):
                # One id per rank in local-rank order; colocated groups repeat ids, which is fine.
                ids = [infos[p]["gpu_ids"][0] for p in peers]
                extra = [g for p in peers for g in infos[p]["gpu_ids"][1:]]
                visible = ",".join(ids + extra)
            per_rank.append(((), dict(
                rank=rank, world_size=self.world_size, local_rank=peers.index(rank), local_world_size=len(peers),
                master_addr=master_addr, master_port=master_port, visible_devices=visible,
                rendezvous_file=rendezvous_file)))
        self.call_ranks(per_rank, Worker.setup_env, timeout_s=timeout_s)
        self.node_infos = infos
        self.master_address = (master_addr, master_port)

    # ------------------------------------------------------------------------- properties

    @property
    def world_size(self) -> int:
        return len(self._actors)

    @property
    def actors(self) -> list:
        """The Ray actor handles, rank order."""
        return list(self._actors)

    @property
    def coordinates(self) -> list[Coordinates]:
        """Every rank's coordinates as the rank reported them (fetched on first use)."""
        if self._coordinates is None:
            self.refresh_coordinates()
        assert self._coordinates is not None
        return self._coordinates

    def refresh_coordinates(self, timeout_s: float | None = None) -> list[Coordinates]:
        """Ask every rank for its coordinates (call after the ranks initialise their parallel groups)."""
        coords = self.call_all(Worker.coordinates, timeout_s=timeout_s)
        for rank, coord in enumerate(coords):
            if coord.rank != rank or coord.world_size != self.world_size:
                raise WorkerError(f"{self.role} rank {rank} reports rank {coord.rank} of {coord.world_size}, "
                                  f"but the group spawned it as rank {rank} of {self.world_size}",
                                  role=self.role, rank=rank, method="coordinates")
        dp_sizes = {c.dp_size for c in coords}
        if len(dp_sizes) != 1:
            raise WorkerError(f"{self.role}: ranks disagree on the data-parallel size: {sorted(dp_sizes)}",
                              role=self.role, rank=None, method="coordinates")
        self._coordinates = coords
        return coords

    @property
    def dp_size(self) -> int:
        return self.coordinates[0].dp_size

    def collect_ranks(self) -> list[int]:
        """For each DP replica in order, the rank whose output stands for it (TP 0, CP 0, last PP stage)."""
        by_dp: dict[int, int] = {}
        for coord in self.coordinates:
            if coord.is_collect_rank:
                if coord.dp_rank in by_dp:
                    raise WorkerError(f"{self.role}: ranks {by_dp[coord.dp_rank]} and {coord.rank} both collect "
                                      f"DP replica {coord.dp_rank}", role=self.role, rank=coord.rank,
                                      method="coordinates")
                by_dp[coord.dp_rank] = coord.rank
        missing = [d for d in range(self.dp_size) if d not in by_dp]
        if missing:
            raise WorkerError(f"{self.role}: no rank collects DP replicas {missing}", role=self.role, rank=None,
                              method="coordinates")
        return [by_dp[d] for d in range(self.dp_size)]

    # ------------------------------------------------------------------------- calls

    def _wait(self, refs: list, method: str, ranks: list[int], timeout_s: float | None) -> list:
        """Results of ``refs`` (rank ``ranks[i]``) in order; the first failure or the timeout raises WorkerError."""
        import ray
        from ray.exceptions import GetTimeoutError, RayActorError, RayTaskError

        timeout_s = self.timeout_s if timeout_s is None else timeout_s
        deadline = time.monotonic() + timeout_s
        index = {ref: i for i, ref in enumerate(refs)}
        results: list = [None] * len(refs)
        pending = list(refs)
        while pending:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                late = sorted(ranks[index[r]] for r in pending)
                raise WorkerError(f"{self.role}.{method}: ranks {late} did not answer within {timeout_s:.0f} s "
                                  f"(hung in a collective or still working; raise {self.timeout_setting or 'the timeout'} if it "
                                  f"is slow)",
                                  role=self.role, rank=late[0], method=method)
            done, pending = ray.wait(pending, num_returns=1, timeout=remaining)
            for ref in done:
                rank = ranks[index[ref]]
                try:
                    results[index[ref]] = ray.get(ref, timeout=max(1.0, remaining))
                except RayActorError as err:
                    raise WorkerError(f"{self.role} rank {rank} died during {method}: {err}", role=self.role,
                                      rank=rank, method=method) from err
                except RayTaskError as err:
                    # A rank that lost a peer mid-collective fails too; report the dead peer (the root cause).
                    self._raise_if_dead([r for r in pending if r not in done], index, ranks, method, err)
                    cause = err.cause if isinstance(getattr(err, "cause", None), BaseException) else err
                    raise WorkerError(f"{self.role} rank {rank} failed in {method}: {type(cause).__name__}: {cause}",
                                      role=self.role, rank=rank, method=method) from err
                except GetTimeoutError as err:
                    raise WorkerError(f"{self.role} rank {rank}: result of {method} not retrievable", role=self.role,
                                      rank=rank, method=method) from err
        return results

    def _raise_if_dead(self, pending: list, index: dict, ranks: list[int], method: str, err: Exception) -> None:
        """Raise WorkerError for the first of ``pending`` whose actor died within a second (else return)."""
        import ray
        from ray.exceptions import RayActorError

        if not pending:
            return
        done, _ = ray.wait(pending, num_returns=len(pending), timeout=1.0)
        for ref in done:
            try:
                ray.get(ref, timeout=1.0)
            except RayActorError as dead:
                rank = ranks[index[ref]]
                raise WorkerError(f"{self.role} rank {rank} died during {method} (other ranks then failed: {err})",
                                  role=self.role, rank=rank, method=method) from dead
            except Exception:  # noqa: BLE001 - another failure; the caller reports the first one
                continue

    def method_name(self, method: Callable[..., Any]) -> str:
        """``method.__name__`` once ``method`` is known to be a method of the group's worker class.

        ``method`` must be the function itself, found by identity in ``worker_cls``'s MRO
        (``@busy`` methods are their class attribute, so ``ActorWorker.update_actor`` is).
        A string, or a function of another class (``CriticWorker.init_model`` on the actor
        group), raises ``TypeError`` naming the role and listing the class's public methods.
        """
        cls = self.worker_cls
        methods = public_methods(cls)
        listing = f"{cls.__name__}'s methods: {', '.join(methods)}"
        if isinstance(method, str):
            close = difflib.get_close_matches(method, methods, n=1)
            example = f"{cls.__name__}.{close[0] if close else '<method>'}"
            raise TypeError(f"{self.role}: got the method name {method!r}; pass the worker method itself, "
                            f"e.g. {example} (WorkerClass.method), not a string. {listing}")
        name = getattr(method, "__name__", None)
        if isinstance(name, str) and _class_attribute(cls, name, method):
            return name
        what = getattr(method, "__qualname__", None) or repr(method)
        hint = ""
        if isinstance(name, str):
            close = difflib.get_close_matches(name, methods, n=1)
            hint = f" (did you mean {cls.__name__}.{close[0]}?)" if close else ""
        raise TypeError(f"{self.role}: {what} is not a method of the group's worker class "
                        f"{cls.__module__}.{cls.__qualname__}{hint}. {listing}")

    def _submit(self, rank: int, name: str, args: Sequence[Any], kwargs: dict[str, Any]):
        try:
            remote_method = getattr(self._actors[rank], name)
        except AttributeError as err:  # a method Ray does not expose on the actor handle
            raise AttributeError(f"{self.role}: the Ray actor of {self.worker_cls.__name__} has no method {name!r}") \
                from err
        return remote_method.remote(*args, **kwargs)

    def call_all(self, method: Callable[..., R], *args: Any, timeout_s: float | None = None,
                 **kwargs: Any) -> list[R]:
        """Call ``method(*args, **kwargs)`` on every rank; the results in rank order."""
        name = self.method_name(method)
        refs = [self._submit(rank, name, args, kwargs) for rank in range(self.world_size)]
        return self._wait(refs, name, list(range(self.world_size)), timeout_s)

    def call_rank(self, rank: int, method: Callable[..., R], *args: Any, timeout_s: float | None = None,
                  **kwargs: Any) -> R:
        """Call ``method(*args, **kwargs)`` on rank ``rank`` only."""
        name = self.method_name(method)
        if not 0 <= rank < self.world_size:
            raise ValueError(f"{self.role}.{name}: rank {rank} outside 0..{self.world_size - 1}")
        return self._wait([self._submit(rank, name, args, kwargs)], name, [rank], timeout_s)[0]

    def call_ranks(self, per_rank_args: Sequence[tuple[tuple, dict]], method: Callable[..., R],
                   timeout_s: float | None = None) -> list[R]:
        """Call ``method`` on every rank with its own ``(args, kwargs)``; the results in rank order."""
        name = self.method_name(method)
        if len(per_rank_args) != self.world_size:
            raise ValueError(f"{self.role}.{name}: {len(per_rank_args)} argument sets for {self.world_size} ranks")
        refs = [self._submit(rank, name, a, k) for rank, (a, k) in enumerate(per_rank_args)]
        return self._wait(refs, name, list(range(self.world_size)), timeout_s)

    def split_by_dp(self, batch: Batch) -> list[Batch]:
        """Rank r's piece: chunk ``dp_rank(r)`` of ``batch`` split into ``dp_size`` equal chunks."""
        chunks = batch.chunk(self.dp_size)
        return [chunks[coord.dp_rank] for coord in self.coordinates]

    def gather_by_dp(self, outputs: Sequence[Any]) -> Any:
        """Concatenate, in DP order, the outputs of each replica's collect rank (``outputs`` in rank order).

        Batches are concatenated with ``Batch.concat``; other outputs come back as a list.
        """
        picked = [outputs[rank] for rank in self.collect_ranks()]
        if all(isinstance(p, Batch) for p in picked):
            return Batch.concat(picked)
        return picked

    def call_dp(self, method: Callable[..., Any], batch: Batch, *args: Any, timeout_s: float | None = None,
                **kwargs: Any) -> Any:
        """Split ``batch`` by DP rank, call ``method(piece, *args, **kwargs)`` on every rank, gather by DP rank."""
        import ray

        self.method_name(method)  # before anything is put into the object store
        pieces = self.split_by_dp(batch)
        # One object per DP chunk, shared by the TP/PP/CP ranks of that replica.
        refs_by_dp = {}
        for coord, piece in zip(self.coordinates, pieces):
            if coord.dp_rank not in refs_by_dp:
                refs_by_dp[coord.dp_rank] = ray.put(piece)
        per_rank = [((refs_by_dp[c.dp_rank], *args), kwargs) for c in self.coordinates]
        return self.gather_by_dp(self.call_ranks(per_rank, method, timeout_s=timeout_s))

    # ------------------------------------------------------------------------- teardown

    def kill_rank(self, rank: int) -> None:
        """Kill one rank's actor (for failure handling and tests)."""
        import ray

        ray.kill(self._actors[rank], no_restart=True)

    def shutdown(self) -> None:
        """Kill every rank's actor (survivors of a failed collective included)."""
        import ray

        for actor in getattr(self, "_actors", []):
            try:
                ray.kill(actor, no_restart=True)
            except Exception:  # already dead
                pass
        self._actors = []
        if getattr(self, "rendezvous_file", None):
            with contextlib.suppress(FileNotFoundError):
                os.remove(self.rendezvous_file)

    def __repr__(self) -> str:
        return f"WorkerGroup(role={self.role!r}, world_size={self.world_size}, pool={self.pool!r}, pid={os.getpid()})"
