"""The four special symbols a fairseq `Dictionary` starts with, and their ids.

The Mega code prepares LRA ListOps, Text, Retrieval and WMT'16 with fairseq dictionaries, so
their vocabularies share these first ids (the dataset's own symbols follow).
"""

SPECIALS = ("<s>", "<pad>", "</s>", "<unk>")
BOS_ID, PAD_ID, EOS_ID, UNK_ID = 0, 1, 2, 3
