"""What turns text into requests and tokens back into text, host only (no jax): tokenizer.json, chat
templates, incremental detokenization with stop strings, tool-call / reasoning parsers."""
