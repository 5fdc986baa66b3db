"""The one place that reads torch's private surfaces, a module per family: Dynamo (`dynamo`), Inductor's
CUDA-graph trees (`cudagraph_trees`), the autograd engine (`autograd_engine`), torch.optim (`optim`) and
FSDP2 (`distributed`), with the feature table they register into (`features`).

Each surface is detected at run time and recorded with the reason it is missing, so a probe degrades one
feature at a time with a logged reason instead of failing on an unexpected torch. The version facts sit
beside the code that depends on them.
"""

from torchpulse.probes.torch_compat import autograd_engine, cudagraph_trees, distributed, dynamo, features, optim

__all__ = ["autograd_engine", "cudagraph_trees", "distributed", "dynamo", "features", "optim"]
