"""transformers' Trainer with the pipe inside, and pretrained directories read and written per rank.

    from gpipe_fast.integrations.transformers import PipelineTrainer

Importing this imports transformers (and, for the Trainer, accelerate); `import gpipe_fast`
does not.
"""

from gpipe_fast.integrations.transformers.pretrained import load_pretrained
from gpipe_fast.integrations.transformers.saving import save_pretrained
from gpipe_fast.integrations.transformers.trainer import PipelineTrainer

__all__ = ["PipelineTrainer", "load_pretrained", "save_pretrained"]
