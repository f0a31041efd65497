"""Chat prompts shared by the golden test and the benchmarks: varied lengths, topics and formats."""

GOLDEN_CHATS: list[list[dict[str, str]]] = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "user", "content": "Write a haiku about the sea."}],
    [{"role": "system", "content": "You are a terse assistant. Answer in one sentence."},
     {"role": "user", "content": "Why is the sky blue?"}],
    [{"role": "user", "content": "List three prime numbers greater than 100 and explain how you checked them."}],
    [{"role": "user", "content": "Translate to French: 'The cat sleeps on the warm windowsill every afternoon.'"}],
    [{"role": "user", "content": "Write a Python function that returns the n-th Fibonacci number."}],
    [{"role": "user", "content": "Hi!"},
     {"role": "assistant", "content": "Hello! How can I help you today?"},
     {"role": "user", "content": "Tell me a short story about a robot who learns to paint, in about five sentences."}],
    [{"role": "user", "content": "Summarize the water cycle for a ten-year-old, covering evaporation, "
                                 "condensation, precipitation and collection, with one example of each."}],
]
