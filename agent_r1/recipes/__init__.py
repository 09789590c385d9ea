"""Task recipes: each is a task generator, an env with its tools, and a reward, in one short file."""
