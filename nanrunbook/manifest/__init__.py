"""The manifest side: strict fields, parsing, contract rules, content id, schema."""
