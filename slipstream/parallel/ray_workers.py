"""Worker ranks as Ray actors (distributed_executor_backend="ray"), in a placement group that
may span nodes: one bundle per rank (a GPU, or a CPU without one), packed onto as few nodes as
fit. Ray places and watches the processes; the transport stays the pool's (ZeroMQ over TCP to
this node, torch.distributed between the ranks), and each actor runs worker.serve.

Start Ray first (`ray start --head` here, `ray start --address HEAD:6379` on the others); the
engine joins that cluster (or starts a local one) with ray.init.
"""
from __future__ import annotations

import socket

from slipstream import envs
from slipstream.parallel.workers import WorkerPool


def _import_ray():
    try:
        import ray
    except ImportError:
        raise ImportError("distributed_executor_backend='ray' needs Ray: pip install "
                          "'slipstream[ray]' (or pip install ray)") from None
    return ray


class _RankActor:
    """One rank: reports where it runs, then serves until shutdown."""

    def node_ip(self) -> str:
        import ray

        return ray.util.get_node_ip_address()

    def free_port(self) -> int:
        with socket.socket() as s:
            s.bind(("", 0))
            return s.getsockname()[1]

    def serve(self, header: dict) -> int:
        from slipstream.parallel.worker import serve

        return serve(header)


class RayWorkerPool(WorkerPool):
    launcher = "ray"

    def __init__(self, world_size: int, device: str):
        ray = _import_ray()
        if not ray.is_initialized():
            try:  # a cluster that `ray start` left running
                ray.init(address="auto", log_to_driver=False)
            except ConnectionError:  # none: a local one, on this machine's resources
                ray.init(log_to_driver=False)
        super().__init__(world_size, device, host=ray.util.get_node_ip_address())

    def _launch(self) -> None:
        ray = _import_ray()
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        gpu = self.backend == "nccl"
        bundle = {"GPU": 1, "CPU": 1} if gpu else {"CPU": 1}
        self.group = placement_group([bundle] * self.world_size, strategy="PACK")
        ray.get(self.group.ready(), timeout=envs.WORKER_START_TIMEOUT_S.get())
        actor_cls = ray.remote(num_cpus=1, num_gpus=1 if gpu else 0)(_RankActor)
        self.actors = [actor_cls.options(scheduling_strategy=PlacementGroupSchedulingStrategy(
            placement_group=self.group, placement_group_bundle_index=rank)).remote()
            for rank in range(self.world_size)]
        # The process group's store listens on rank 0's node.
        ip = ray.get(self.actors[0].node_ip.remote())
        self.init_method = f"tcp://{ip}:{ray.get(self.actors[0].free_port.remote())}"
        device = "cuda:0" if gpu else "cpu"  # Ray gives each actor its own visible GPU
        self.runs = [actor.serve.remote(self.header(rank, device))
                     for rank, actor in enumerate(self.actors)]

    def _dead_workers(self) -> dict[int, str]:
        ray = _import_ray()
        done, _ = ray.wait(list(getattr(self, "runs", [])), num_returns=len(self.runs),
                           timeout=0) if getattr(self, "runs", None) else ([], [])
        dead = {}
        for ref in done:
            rank = self.runs.index(ref)
            try:
                code = ray.get(ref)
                dead[rank] = f"worker rank {rank} (Ray actor) exited with code {code}"
            except Exception as exc:  # noqa: BLE001 - the actor died: say how
                dead[rank] = f"worker rank {rank} (Ray actor) died: {type(exc).__name__}"
        return dead

    def _stop_workers(self) -> None:
        ray = _import_ray()
        for actor in getattr(self, "actors", []):
            ray.kill(actor)
        if getattr(self, "group", None) is not None:
            from ray.util.placement_group import remove_placement_group

            remove_placement_group(self.group)

