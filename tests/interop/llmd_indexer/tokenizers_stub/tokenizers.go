// Package tokenizers stands in for github.com/daulet/tokenizers (cgo bindings to
// HuggingFace's Rust tokenizers) in the llm-d indexer test helper: it has the API that
// llm-d-kv-cache-manager v0.3.0's pkg/tokenization compiles against, and every entry point
// that would load or run a tokenizer fails. The helper takes token ids, never text.
package tokenizers

import "errors"

// ErrStub is returned by every call that would need the real tokenizers library.
var ErrStub = errors.New("tokenizers: stub (the llm-d indexer test helper takes token ids)")

// Offset is a token's [start, end) byte range in the input text.
type Offset [2]uint

// Tokenizer is never constructed: FromPretrained always fails.
type Tokenizer struct{}

// Encoding is the result of an encode call.
type Encoding struct {
	IDs     []uint32
	Offsets []Offset
}

type tokenizerConfig struct{}

// TokenizerConfigOption configures FromPretrained.
type TokenizerConfigOption func(*tokenizerConfig)

// WithCacheDir is accepted and ignored.
func WithCacheDir(string) TokenizerConfigOption { return func(*tokenizerConfig) {} }

// WithAuthToken is accepted and ignored.
func WithAuthToken(string) TokenizerConfigOption { return func(*tokenizerConfig) {} }

// FromPretrained always fails.
func FromPretrained(string, ...TokenizerConfigOption) (*Tokenizer, error) { return nil, ErrStub }

type encodeOptions struct{}

// EncodeOption configures EncodeWithOptions.
type EncodeOption func(*encodeOptions)

// WithReturnTypeIDs is accepted and ignored.
func WithReturnTypeIDs() EncodeOption { return func(*encodeOptions) {} }

// WithReturnOffsets is accepted and ignored.
func WithReturnOffsets() EncodeOption { return func(*encodeOptions) {} }

// EncodeWithOptions is unreachable (no Tokenizer exists); it panics if called.
func (*Tokenizer) EncodeWithOptions(string, bool, ...EncodeOption) Encoding {
	panic(ErrStub)
}
