"""From logits to text: the decode session, sampling, prompt lookup, perplexity."""
