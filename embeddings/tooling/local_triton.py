"""The local Triton configured from settings, shared by `runtriton`, `runstack` and the benchmarks."""

from __future__ import annotations

from pathlib import Path

from django.conf import settings
from django.core.exceptions import ImproperlyConfigured

from embeddings.tooling.triton_server import TritonServer
from embeddings.triton.targets import TritonTarget


def local_triton_server(*, log_path: Path | None = None, extra_repositories: list[Path] = ()) -> TritonServer:
    """A TritonServer on this machine's configured ports, serving the model repository."""
    if TritonTarget.of_grpc_target(settings.TRITON_GRPC_TARGET).replicated:
        raise ImproperlyConfigured(
            "A local Triton is one server: TRITON_SERVER_URL names several replicas "
            f"({settings.TRITON_GRPC_TARGET}); start each replica on its own host"
        )
    grpc_host, _, grpc_port = settings.TRITON_GRPC_TARGET.rpartition(":")
    return TritonServer(
        model_repositories=[Path(settings.TRITON_MODEL_REPOSITORY), *extra_repositories],
        run_dir=Path(settings.RUN_DIR),
        grpc_port=int(grpc_port),
        http_port=settings.TRITON_HTTP_PORT,
        metrics_port=settings.TRITON_METRICS_PORT,
        address="127.0.0.1" if grpc_host in {"localhost", "127.0.0.1"} else grpc_host.strip("[]"),
        model_config_name=settings.TRITON_MODEL_CONFIG_NAME,
        model_control_mode=settings.TRITON_MODEL_CONTROL_MODE,
        startup_models=settings.TRITON_STARTUP_MODELS
        if settings.TRITON_MODEL_CONTROL_MODE == "explicit"
        else (),
        log_path=log_path,
        stop_timeout_s=settings.TRITON_STOP_TIMEOUT_S,
    )
