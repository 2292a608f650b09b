// llmd-indexer: llm-d's precise prefix-cache indexer (llm-d-kv-cache-manager v0.3.0) behind
// a small HTTP API, for kvpilot's interop tests (tests/interop/llmd.py).
//
// Everything that matters is llm-d's code: kvevents.Pool (its ZMQ SUB socket, which binds
// --zmq-endpoint, and its event decoding and digestion) feeds a kvblock.InMemoryIndex;
// /keys runs kvblock.ChunkedTokenDatabase; /score replicates kvcache.Indexer.GetPodScores
// (TokensToKVBlockKeys, Index.Lookup, the LongestPrefix KVBlockScorer) minus the
// tokenization step: it takes token ids. This file is only glue.
//
//	GET  /healthz
//	POST /keys  {"model": str, "token_ids": [uint32]}                 -> {"keys": [uint64]}
//	POST /score {"model": str, "token_ids": [uint32], "pods": [str]?} -> {"scores": {pod: int}}
//
// One line "ready ..." goes to stdout once the HTTP listener is bound and llm-d's
// subscriber has bound its socket; logs go to stderr.
package main

import (
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"net"
	"net/http"
	"os"
	"os/signal"
	"strings"
	"sync"
	"syscall"
	"time"

	"github.com/go-logr/logr"
	"github.com/go-logr/logr/funcr"
	"k8s.io/apimachinery/pkg/util/sets"
	"k8s.io/klog/v2"

	"github.com/llm-d/llm-d-kv-cache-manager/pkg/kvcache"
	"github.com/llm-d/llm-d-kv-cache-manager/pkg/kvcache/kvblock"
	"github.com/llm-d/llm-d-kv-cache-manager/pkg/kvcache/kvevents"
)

// boundMessage is what llm-d's zmq subscriber logs once its SUB socket is bound.
const boundMessage = "Bound subscriber socket"

type server struct {
	tokens kvblock.TokenProcessor
	index  kvblock.Index
	scorer kvcache.KVBlockScorer
}

type request struct {
	Model    string   `json:"model"`
	TokenIDs []uint32 `json:"token_ids"`
	Pods     []string `json:"pods"`
}

func main() {
	zmqEndpoint := flag.String("zmq-endpoint", "tcp://127.0.0.1:5557",
		"where llm-d's SUB socket binds (engines connect their PUB sockets to it)")
	httpAddr := flag.String("http", "127.0.0.1:8080", "host:port of the HTTP API")
	hashSeed := flag.String("hash-seed", "", "llm-d's HashSeed: the engines' PYTHONHASHSEED")
	blockSize := flag.Int("block-size", 16, "tokens per KV block")
	topicFilter := flag.String("topic-filter", "kv@", "ZMQ subscription prefix")
	verbosity := flag.Int("v", 0, "log verbosity (llm-d logs events at 4, index operations at 5)")
	flag.Parse()

	bound := make(chan struct{})
	var once sync.Once
	logger := funcr.New(func(prefix, args string) {
		fmt.Fprintln(os.Stderr, prefix, args)
		if strings.Contains(args, boundMessage) {
			once.Do(func() { close(bound) })
		}
	}, funcr.Options{Verbosity: *verbosity, LogTimestamp: true})
	klog.SetLogger(logger)

	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGINT, syscall.SIGTERM)
	defer stop()
	ctx = klog.NewContext(ctx, logger)

	if err := run(ctx, logger, bound, *zmqEndpoint, *httpAddr, *hashSeed, *blockSize, *topicFilter); err != nil {
		fmt.Fprintln(os.Stderr, "llmd-indexer:", err)
		os.Exit(1)
	}
}

func run(ctx context.Context, logger logr.Logger, bound <-chan struct{},
	zmqEndpoint, httpAddr, hashSeed string, blockSize int, topicFilter string,
) error {
	index, err := kvblock.NewIndex(ctx, kvblock.DefaultIndexConfig())
	if err != nil {
		return err
	}
	scorer, err := kvcache.NewKVBlockScorer(kvcache.DefaultKVBlockScorerConfig())
	if err != nil {
		return err
	}
	srv := &server{
		tokens: kvblock.NewChunkedTokenDatabase(&kvblock.TokenProcessorConfig{
			BlockSize: blockSize, HashSeed: hashSeed,
		}),
		index:  index,
		scorer: scorer,
	}

	poolCfg := kvevents.DefaultConfig()
	poolCfg.ZMQEndpoint = zmqEndpoint
	poolCfg.TopicFilter = topicFilter
	pool := kvevents.NewPool(poolCfg, index)
	pool.Start(ctx)
	defer pool.Shutdown(context.Background())

	listener, err := net.Listen("tcp", httpAddr)
	if err != nil {
		return err
	}
	mux := http.NewServeMux()
	mux.HandleFunc("GET /healthz", func(w http.ResponseWriter, _ *http.Request) {
		writeJSON(w, http.StatusOK, map[string]string{"status": "ok"})
	})
	mux.HandleFunc("POST /keys", srv.keys)
	mux.HandleFunc("POST /score", srv.score)
	httpServer := &http.Server{Handler: mux, ReadHeaderTimeout: 10 * time.Second}
	served := make(chan error, 1)
	go func() { served <- httpServer.Serve(listener) }()

	select {
	case <-bound:
	case <-time.After(30 * time.Second):
		return fmt.Errorf("llm-d's subscriber did not bind %s within 30s", zmqEndpoint)
	case <-ctx.Done():
		return nil
	}
	fmt.Printf("ready http=%s zmq=%s\n", listener.Addr(), zmqEndpoint)
	logger.Info("ready", "http", listener.Addr().String(), "zmq", zmqEndpoint,
		"hashSeed", hashSeed, "blockSize", blockSize, "topicFilter", topicFilter)

	select {
	case <-ctx.Done():
	case err := <-served:
		return err
	}
	shutdownCtx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	if err := httpServer.Shutdown(shutdownCtx); err != nil && !errors.Is(err, http.ErrServerClosed) {
		return err
	}
	return nil
}

func (s *server) keys(w http.ResponseWriter, r *http.Request) {
	var req request
	if !readJSON(w, r, &req) {
		return
	}
	keys := s.tokens.TokensToKVBlockKeys(req.TokenIDs, req.Model)
	hashes := make([]uint64, len(keys))
	for i, key := range keys {
		hashes[i] = key.ChunkHash
	}
	writeJSON(w, http.StatusOK, map[string]any{"keys": hashes})
}

// score is kvcache.Indexer.GetPodScores after its tokenization step (v0.3.0, steps 2-4).
func (s *server) score(w http.ResponseWriter, r *http.Request) {
	var req request
	if !readJSON(w, r, &req) {
		return
	}
	blockKeys := s.tokens.TokensToKVBlockKeys(req.TokenIDs, req.Model)
	keyToPods, err := s.index.Lookup(r.Context(), blockKeys, sets.New(req.Pods...))
	if err != nil {
		writeJSON(w, http.StatusUnprocessableEntity,
			map[string]string{"error": fmt.Sprintf("failed to query kvblock indexer: %v", err)})
		return
	}
	podScores, err := s.scorer.Score(blockKeys, keyToPods)
	if err != nil {
		writeJSON(w, http.StatusUnprocessableEntity,
			map[string]string{"error": fmt.Sprintf("failed to query kvblock scorer: %v", err)})
		return
	}
	writeJSON(w, http.StatusOK, map[string]any{"scores": podScores})
}

func readJSON(w http.ResponseWriter, r *http.Request, into *request) bool {
	decoder := json.NewDecoder(r.Body)
	decoder.DisallowUnknownFields()
	if err := decoder.Decode(into); err != nil {
		writeJSON(w, http.StatusBadRequest, map[string]string{"error": err.Error()})
		return false
	}
	if into.Model == "" {
		writeJSON(w, http.StatusBadRequest, map[string]string{"error": "model is required"})
		return false
	}
	return true
}

func writeJSON(w http.ResponseWriter, status int, body any) {
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(status)
	_ = json.NewEncoder(w).Encode(body)
}
