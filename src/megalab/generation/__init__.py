"""Decoding and scoring of sequence-to-sequence models: beam search (`beam`) and BLEU (`bleu`)."""
