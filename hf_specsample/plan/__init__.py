"""A call's inputs turned into a frozen plan: every refusal before any forward, every decision once."""
