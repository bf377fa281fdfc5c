"""Document-level translation: attention restricted to the aligned sentence of a document sample."""
