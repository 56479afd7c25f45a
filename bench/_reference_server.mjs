// The Durable Streams reference server (@durable-streams/server) for bench/door.py, on
// 127.0.0.1 only:
//
//     node _reference_server.mjs PACKAGE_FOLDER memory|file DATA_FOLDER PORT
//
// PACKAGE_FOLDER is where npm installed the package; `file` keeps the streams in
// DATA_FOLDER (append-only segment files, an fdatasync per append, LMDB for metadata),
// `memory` keeps them in this process. It prints "ready URL" once it listens, and stops
// on SIGTERM or SIGINT.
import { createRequire } from "node:module"
import path from "node:path"

const [packageFolder, mode, dataFolder, port] = process.argv.slice(2)
if (!packageFolder || !["memory", "file"].includes(mode) || !dataFolder || !port) {
  console.error("usage: node _reference_server.mjs PACKAGE_FOLDER memory|file DATA_FOLDER PORT")
  process.exit(2)
}
// the package lives in a cache folder, not beside this file: resolve it from there
const load = createRequire(path.join(packageFolder, "package.json"))
const { DurableStreamTestServer } = load("@durable-streams/server")

const server = new DurableStreamTestServer({
  host: "127.0.0.1",
  port: Number(port),
  dataDir: mode === "file" ? dataFolder : undefined,
})
const url = await server.start()
console.log(`ready ${url}`)

let stopping = false
for (const signal of ["SIGTERM", "SIGINT"]) {
  process.on(signal, async () => {
    if (stopping) return
    stopping = true
    await server.stop()
    process.exit(0)
  })
}
