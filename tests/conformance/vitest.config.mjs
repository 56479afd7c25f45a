import { defineConfig } from "vitest/config"

export default defineConfig({
  test: {
    include: ["durable-streams.test.mjs"],
    // one server, shared: the cases run one after another, as the reference's own CI does
    fileParallelism: false,
    testTimeout: 30000,
    hookTimeout: 30000,
  },
})
