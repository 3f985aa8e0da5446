"""Expert parallelism's public path (docs/parallel.md): `from qwen3layer.parallel import
ExpertParallelLayer`. The code lives in qwen3layer.placement.parallel; this module re-exports
its public names (its __all__), the same objects, and holds nothing else. It is a module of
its own, not an alias registered by the package, because importing it imports torch and
torch.distributed, which `import qwen3layer` must not: a missing torch fails here, at the
import, naming torch."""
from .placement.parallel import ExpertParallelLayer, contiguous_placement

__all__ = ["ExpertParallelLayer", "contiguous_placement"]
