// The official Durable Streams conformance suite against the server at
// CONFORMANCE_TEST_URL (a `subengine serve --durable-streams` and its prefix). The
// package's own `--run` CLI finds no test files under vitest 4, so this file is the
// whole wrapper: it registers the suite's cases with vitest.
import { runConformanceTests } from "@durable-streams/server-conformance-tests"

const baseUrl = process.env.CONFORMANCE_TEST_URL
if (!baseUrl) {
  throw new Error("set CONFORMANCE_TEST_URL to the server's Durable Streams base URL")
}

runConformanceTests({
  baseUrl,
  // the server's long-poll wait (serve --durable-streams-long-poll), in milliseconds
  longPollTimeoutMs: Number(process.env.CONFORMANCE_LONG_POLL_MS ?? "20000"),
})
