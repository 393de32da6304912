"""Special token ids, shared by the tokenizer (which reserves them) and the models (which use them)."""

PAD_ID, UNK_ID, BOS_ID, EOS_ID = 0, 1, 2, 3  # <pad> <unk> <s> </s>
