"""Heat's DASO interface on gradwire: a training script or test written for Heat's DASO runs
with `import heat as ht` changed to `import gradwire.heat as ht` (and `heat.x` imports to
`gradwire.heat.x`). It provides what Heat's own DASO test and examples use:

- `ht.optim.DASO` (gradwire's, Heat's arguments and schedule) and torch's optimizers
  (`ht.optim.SGD` is `torch.optim.SGD`, as in Heat);
- `ht.nn.DataParallelMultiGPU`, torch's layers (`ht.nn.Module`, `ht.nn.Conv2d`, ...) and
  `ht.nn.functional`, as in Heat;
- `ht.MPI_WORLD` (`rank`, `size`, `Allreduce`, `Bcast`, `Barrier`) and `ht.MPI` (`SUM`,
  `MAX`, `MIN`, `PROD`, `Finalize`) over gradwire's communicator for the whole job;
- `ht.get_device()`, `ht.use_device()`, `ht.cpu`, `ht.gpu` (which device tensors go to);
- `ht.utils.data.Dataset` (a map-style dataset over one local tensor).

The ranks come from `gradwire launch` (or torchrun), not from mpirun; a node is the
launcher's (`--netns --ranks-per-node G`). As in Heat, `last_batch` is the index of the
epoch's last batch (`len(loader) - 1`); a wrong one is an error at `epoch_loss_logic`,
not a silent drift. Heat's distributed arrays (`DNDarray`) are not provided.
"""

from gradwire.heat import nn, optim, utils
from gradwire.heat._world import MPI, MPI_WORLD, cpu, get_device, gpu, use_device

__all__ = ["MPI", "MPI_WORLD", "cpu", "get_device", "gpu", "nn", "optim", "use_device", "utils"]
