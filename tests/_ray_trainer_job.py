"""Ray Train's ``TorchTrainer`` running ``tests._diverging_reads_program.train`` on 2 CPU workers with
gloo, ``SAFEIO_PATCH=1`` given to the workers through the runtime environment, as a user adopting safeio
without editing the script would (issue 32, item 0). The driver itself is not patched.

    python -m tests._ray_trainer_job OUTPUT_DIR REPORT_DIR STORAGE_DIR

Exits 0 once ``fit()`` returns without an error; the workers' reports are in REPORT_DIR.
"""

from __future__ import annotations

import os
import sys
from typing import Any

import ray
from ray.train import RunConfig, ScalingConfig
from ray.train.torch import TorchConfig, TorchTrainer

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _loop(config: dict[str, Any]) -> None:
    from tests._diverging_reads_program import train

    train(config["output_dir"], config["report_dir"])


def main() -> int:
    output_dir, report_dir, storage = sys.argv[1:4]
    workers_env = {
        "SAFEIO_PATCH": "1",
        "PYTHONPATH": ROOT,  # the workers import this test package
        "OMP_NUM_THREADS": "1",
        "HF_HUB_OFFLINE": "1",
        # Under load a rank's wait can approach safeio's default bound: keep the default (30 min) out of
        # a stalled run's way: the harness's own bound ends a stall.
    }
    if "SAFEIO_TIMEOUT" in os.environ:
        workers_env["SAFEIO_TIMEOUT"] = os.environ["SAFEIO_TIMEOUT"]
    ray.init(
        num_cpus=2,
        include_dashboard=False,
        log_to_driver=True,
        runtime_env={"env_vars": workers_env},
    )
    try:
        trainer = TorchTrainer(
            _loop,
            train_loop_config={"output_dir": output_dir, "report_dir": report_dir},
            scaling_config=ScalingConfig(num_workers=2, use_gpu=False),
            torch_config=TorchConfig(backend="gloo"),
            run_config=RunConfig(storage_path=storage, name="diverging-reads"),
        )
        result = trainer.fit()
        return 0 if result.error is None else 1
    finally:
        ray.shutdown()


if __name__ == "__main__":
    sys.exit(main())
