"""The run: length, machines, checkpoints, validation, logging (``trainer.*``)."""

from __future__ import annotations

import dataclasses

from megarl.config.async_training import TRAINING_MODES
from megarl.config.common import check_choice, check_positive

DEVICES = ("cpu", "cuda")
RESUME_MODES = ("auto", "disable", "resume_path")
LOGGERS = ("console", "tensorboard", "jsonl", "wandb", "mlflow", "swanlab")
INTRA_NODE_LINKS = ("nvlink", "pcie")


@dataclasses.dataclass(kw_only=True)
class LinksConfig:
    """What ``megarl-plan`` assumes for its weight-sync estimate (``trainer.links.*``): bandwidths in GB/s (1e9
    bytes per second) one way, per GPU, and the engine's cost per request. The defaults are an H100 SXM node:
    NVLink 4 (900 GB/s both ways), PCIe 5 x16, one 400 Gb/s InfiniBand NIC per GPU, HBM3."""

    nvlink_gbps: float = 450.0
    """GPU to GPU within a node over NVLink."""
    pcie_gbps: float = 55.0
    """GPU to GPU within a node over PCIe (nodes without NVLink: set ``intra_node=pcie``)."""
    infiniband_gbps: float = 50.0
    """Between nodes, per GPU (its own NIC: 400 Gb/s = 50 GB/s)."""
    hbm_gbps: float = 3350.0
    """A GPU's own memory (an engine copying its shard out of a bucket)."""
    request_ms: float = 10.0
    """Milliseconds an engine spends on one weight-update request besides moving bytes (HTTP, its scheduler
    handing the request to every TP rank, opening handles, the loader's per-tensor work): one per bucket."""
    intra_node: str = "nvlink"
    """How GPUs of one node talk: ``nvlink`` or ``pcie``."""

    def __post_init__(self) -> None:
        for key in ("nvlink_gbps", "pcie_gbps", "infiniband_gbps", "hbm_gbps", "request_ms"):
            check_positive(f"trainer.links.{key}", getattr(self, key))
        check_choice("trainer.links.intra_node", self.intra_node, INTRA_NODE_LINKS)

    def physical(self, link: str) -> str:
        """The link ``link`` names: ``intra_node`` is ``nvlink`` or ``pcie``; others are themselves."""
        return self.intra_node if link == "intra_node" else link

    def gbps(self, link: str) -> float:
        """GB/s of ``link``: ``intra_node``, ``infiniband`` or ``hbm``."""
        return getattr(self, f"{self.physical(link)}_gbps")


@dataclasses.dataclass(kw_only=True)
class TrainerConfig:
    """The run: length, machines, checkpoints, validation, logging (``trainer.*``)."""

    total_epochs: int = 1
    """Passes over the training prompts."""
    total_steps: int | None = None
    """Training steps; None: ``total_epochs`` × batches per epoch. When set it wins over ``total_epochs``."""
    device: str = "cuda"
    """``cuda`` (GPU workers, NCCL) or ``cpu`` (gloo workers; for tests and the tiny recipe)."""
    nnodes: int = 1
    """Machines, with ``device=cuda``."""
    n_gpus_per_node: int = 8
    """GPUs per machine, with ``device=cuda``."""
    n_cpu_ranks: int = 2
    """Worker processes (gloo ranks) on this machine, with ``device=cpu``: the CPU world size."""
    gpu_memory_gb: float = 80.0
    """Memory of one GPU in GiB (2^30 bytes), with ``device=cuda``: what ``megarl-plan`` and the trainer's
    pre-flight check (``megarl.plan.preflight``) plan against. An "80 GB" A100/H100 has 80 GiB of HBM, of
    which CUDA reports about 79.2 as usable; set less to keep headroom."""
    host_memory_gb: float | None = None
    """Memory of the driver's machine in GiB, which holds every step's batch: what ``megarl-plan`` and the
    pre-flight check plan a step's trajectories against. None: the physical memory of the machine that plans."""
    links: LinksConfig = dataclasses.field(default_factory=LinksConfig)
    """Bandwidths of the GPUs' links, with ``device=cuda``: what ``megarl-plan`` estimates the weight sync from."""
    seed: int = 1
    """Seed of data order, sampling and initialization."""
    critic_warmup: int = 0
    """Steps that train only the critic before the actor starts updating."""
    balance_batch: bool = True
    """Reorder trajectories so each data-parallel rank gets a similar token count."""
    val_before_train: bool = True
    """Validate before the first step."""
    val_only: bool = False
    """Validate once and stop."""
    test_freq: int = -1
    """Validate every this many steps (and at the last one); -1: never during training."""
    save_freq: int = -1
    """Checkpoint every this many steps (and at the last one); -1: never."""
    default_local_dir: str = "checkpoints"
    """Checkpoint root: ``<default_local_dir>/<project_name>/<experiment_name>/global_step_<k>``."""
    max_actor_ckpt_to_keep: int | None = None
    """Checkpoints kept; older ones are deleted. None: keep all."""
    resume_mode: str = "auto"
    """``auto`` (latest checkpoint if any), ``disable`` or ``resume_path``."""
    resume_from_path: str | None = None
    """Checkpoint directory to resume from, with ``resume_mode=resume_path``."""
    export_hf: bool = False
    """Also write HF-format weights with each checkpoint."""
    logger: list[str] = dataclasses.field(default_factory=lambda: ["console", "tensorboard"])
    """Metric sinks: ``console``, ``tensorboard``, ``jsonl``, and the hosted trackers ``wandb``, ``mlflow``,
    ``swanlab`` (verl's names; each needs its extra: ``pip install 'megarl[wandb]'``). The trackers get
    ``project_name`` as the project, ``experiment_name`` as the run's name, the whole config, each step's metrics;
    where they write and which environment variables they read: :mod:`megarl.controller.tracking_backends`."""
    log_dir: str = "runs"
    """Root of the logs: ``<log_dir>/<project_name>/<experiment_name>`` (TensorBoard, jsonl, wandb, swanlab);
    MLflow's default store ``<log_dir>/mlflow.db``."""
    project_name: str = "megarl"
    """Project name (log and checkpoint folders)."""
    experiment_name: str = "default"
    """Experiment name (log and checkpoint folders)."""
    rollout_data_dir: str | None = None
    """Write each step's trajectories as jsonl here; None: off."""
    log_val_generations: int = 0
    """Validation samples (prompt, response, score) logged per validation to the console, TensorBoard (text)
    and jsonl sinks; 0: none."""
    mode: str = "sync"
    """``sync`` (generate, then train), ``one_step_off`` (the next step's batch generates while this one trains)
    or ``fully_async`` (engines generate continuously within ``async_training.*``): megarl.config.async_training."""
    worker_timeout_s: float = 1800.0
    """Longest a single worker call may take (one generation, update, sync or checkpoint save) before the
    run fails naming the rank that did not answer: a rank hung in a collective would otherwise stall the run
    for ever. Raise it for very large models or slow file systems."""

    def __post_init__(self) -> None:
        check_positive("trainer.total_epochs", self.total_epochs)
        check_positive("trainer.total_steps", self.total_steps, allow_none=True)
        check_choice("trainer.device", self.device, DEVICES)
        check_positive("trainer.nnodes", self.nnodes)
        check_positive("trainer.n_gpus_per_node", self.n_gpus_per_node)
        check_positive("trainer.n_cpu_ranks", self.n_cpu_ranks)
        check_positive("trainer.gpu_memory_gb", self.gpu_memory_gb)
        check_positive("trainer.host_memory_gb", self.host_memory_gb, allow_none=True)
        check_choice("trainer.resume_mode", self.resume_mode, RESUME_MODES)
        if self.resume_mode == "resume_path" and not self.resume_from_path:
            raise ValueError("trainer.resume_mode=resume_path needs trainer.resume_from_path")
        for key in ("test_freq", "save_freq"):
            value = getattr(self, key)
            if value == 0 or value < -1:
                raise ValueError(f"trainer.{key} must be -1 (off) or >= 1, got {value}")
        if self.critic_warmup < 0:
            raise ValueError(f"trainer.critic_warmup must be >= 0, got {self.critic_warmup}")
        check_positive("trainer.max_actor_ckpt_to_keep", self.max_actor_ckpt_to_keep, allow_none=True)
        if self.log_val_generations < 0:
            raise ValueError(f"trainer.log_val_generations must be >= 0, got {self.log_val_generations}")
        check_positive("trainer.worker_timeout_s", self.worker_timeout_s)
        check_choice("trainer.mode", self.mode, TRAINING_MODES)
        for name in self.logger:
            check_choice("trainer.logger", name, LOGGERS)
        for key in ("project_name", "experiment_name"):
            check_folder_name(f"trainer.{key}", getattr(self, key))

    @property
    def world_size(self) -> int:
        """Ranks shared by the colocated roles: ``nnodes × n_gpus_per_node`` on cuda, ``n_cpu_ranks`` on cpu."""
        return self.n_cpu_ranks if self.device == "cpu" else self.nnodes * self.n_gpus_per_node


def check_folder_name(key: str, value: str) -> None:
    """``value`` names one folder inside the checkpoint and log roots: not empty, no path separator, not ``.`` or
    ``..`` (``../../x`` or an absolute path would put the run's files outside the roots)."""
    if not value or value in (".", "..") or "/" in value or "\\" in value or "\0" in value:
        raise ValueError(f"{key}={value!r} must name one folder (no '/', not '.' or '..'): it is a folder of "
                         f"trainer.default_local_dir and trainer.log_dir; to move a run's files, set those instead")
