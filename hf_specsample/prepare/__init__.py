"""Drafts made ready before a call: `PreparedDraft` and its weak cache, int8 and vocabulary-subset forms, the timed
choice between them, self-drafts made from the target."""
