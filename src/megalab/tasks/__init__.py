"""LightningModules: classification, two-tower retrieval and language modelling."""

from megalab.tasks.classification import ClassificationTask, RetrievalTask
from megalab.tasks.language_modeling import LanguageModelingTask

__all__ = ["ClassificationTask", "LanguageModelingTask", "RetrievalTask"]
