"""Drafters behind one contract (`base.Proposer`): a draft model, n-gram lookup, drafts with another tokenizer."""
