"""What the launcher told this process (adasum_lightning.launch_environment), and the rule that it started the
processes the Trainer or Fabric describes."""

import pytest

from adasum_lightning.errors import AdasumConfigurationError
from adasum_lightning.launch_environment import check_launcher_world_size, detect_launcher


@pytest.mark.parametrize(
    ("environ", "expected"),
    [
        ({}, None),
        ({"OMPI_COMM_WORLD_SIZE": "4"}, ("mpirun / horovodrun (Open MPI)", 4, True)),
        ({"HOROVOD_SIZE": "2", "OMPI_COMM_WORLD_SIZE": "2"}, ("horovodrun --gloo", 2, True)),
        ({"TORCHELASTIC_RUN_ID": "x", "WORLD_SIZE": "2", "RANK": "1"}, ("torchrun", 2, False)),
        ({"SLURM_STEP_ID": "0", "SLURM_STEP_NUM_TASKS": "8"}, ("srun (SLURM)", 8, False)),
        ({"SLURM_NTASKS": "8"}, None),  # an sbatch script itself, not a step: nothing was launched
        ({"WORLD_SIZE": "3", "LOCAL_RANK": "0"}, ("a torch.distributed launcher", 3, False)),
    ],
)
def test_detect_launcher(environ, expected):
    seen = detect_launcher(environ)
    if expected is None:
        assert seen is None
    else:
        assert (seen.name.split(" (Lightning")[0], seen.processes, seen.horovod) == expected


def test_launcher_world_size_rule():
    check_launcher_world_size(8, 4, 2)
    with pytest.raises(
        AdasumConfigurationError, match=r"WORLD_SIZE=8\), but the Trainer describes devices=4 × num_nodes=1"
    ):
        check_launcher_world_size(8, 4, 1)
    with pytest.raises(AdasumConfigurationError, match=r"^ddp_adasum: .* Set Fabric\(devices=<processes per"):
        check_launcher_world_size(8, 4, 1, api="Fabric")
