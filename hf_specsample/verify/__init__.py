"""What turns the target's logits into committed tokens: logits processors per position (and their exact sort-free
forms), the acceptance rules, the stopping criteria."""
