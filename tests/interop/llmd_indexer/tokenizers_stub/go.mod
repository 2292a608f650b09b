module github.com/daulet/tokenizers

go 1.24.1
