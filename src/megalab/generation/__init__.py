"""Decoding: sampling from language models (`sampling`), and for sequence-to-sequence models
beam search (`beam`) and BLEU (`bleu`)."""
