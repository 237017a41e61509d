"""What every layer shares: options' companions that hold state or facts (the row book and token buffer, a round's
draft tree, a model's facts, the device helpers, what we borrow from transformers, our folder on disk)."""
