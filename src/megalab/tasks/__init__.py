"""LightningModules: classification, two-tower retrieval, language modelling and seq2seq."""

from megalab.tasks.classification import ClassificationTask, RetrievalTask
from megalab.tasks.language_modeling import LanguageModelingTask
from megalab.tasks.seq2seq import Seq2SeqTask

__all__ = ["ClassificationTask", "LanguageModelingTask", "RetrievalTask", "Seq2SeqTask"]
