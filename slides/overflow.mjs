// node slides/overflow.mjs CHROMIUM DECK.html: print overflow.js's report on a deck built with
// Marp's bare template (every page laid out, none hidden), as JSON, for slides/build.py.
//
// The page is measured once it has loaded, images included, and two frames later: Marp's script
// scales wide code blocks down after layout, and the slide shows them scaled. The sandbox is off
// because the page is our own offline build and containers rarely allow it; Marp does the same.
import { fileURLToPath, pathToFileURL } from "node:url";
import puppeteer from "puppeteer-core";

const [chromium, deck] = process.argv.slice(2);
const browser = await puppeteer.launch({
  executablePath: chromium, headless: true, args: ["--no-sandbox", "--disable-gpu"],
});
try {
  const page = await browser.newPage();
  await page.setViewport({ width: 1280, height: 720 });
  await page.goto(pathToFileURL(deck).href, { waitUntil: "load" });
  await page.evaluate(() => new Promise((done) => requestAnimationFrame(() => requestAnimationFrame(done))));
  await page.addScriptTag({ path: fileURLToPath(new URL("./overflow.js", import.meta.url)) });
  process.stdout.write(JSON.stringify(await page.evaluate(() => measureOverflow())));
} finally {
  await browser.close();
}
