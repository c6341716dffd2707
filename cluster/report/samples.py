"""The report's sample browser: per task, its samples with each model's (and each output's) completion,
score and status, the rows where they disagree first.

A row is one (task, sample_id, completion); its cells are the columns of the comparison (cluster/report/
comparison.py): each model of each output. Rows are ordered: the columns disagree (on score or on status)
first, then rows some column did not get ok, then the rest, each by sample id (shorter first: q2, q10). At most `limit`
rows per task go on the page (the page says how many there are), so a sweep of millions of rows makes a
page of a few megabytes: only the key columns of every row are read, and the texts of the rows shown.
The rows travel as JSON inside the page; a small script draws them, filters (status, score, disagreement,
text) and pages them. Texts are cut at TEXT_CHARS characters, saying how many more there were, and their
unprintable characters (a NUL, an escape sequence) are written as escapes (`\\x00`, `\\x1b`: html_parts.visible).
"""

from __future__ import annotations

import json
import math
from collections import defaultdict

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from cluster.report.comparison import Output, column_label
from cluster.report.html_parts import note, section, visible
from cluster.report.reading import columns_of, committed

LIMIT = 200  # rows per task on the page
TEXT_CHARS = 1500
KEYS = ["model", "task", "sample_id", "completion", "status", "score"]
TEXTS = ["model", "sample_id", "completion", "prompt", "output_text", "target", "error", "exec_status",
         "exec_error", "finish_reason"]


def browser(outputs: list[Output], limit: int = LIMIT) -> str:
    data = sample_rows(outputs, limit)
    if not data["tasks"]:
        return section("Samples", "samples", note("No committed result shards: no sample to show."))
    # <, > and & as JSON escapes: no text of a row can end the script element or read as markup
    # a NaN or infinite score (a scorer's) as the string "NaN", "inf" or "-inf": JSON has no such number
    payload = json.dumps(_finite(data), ensure_ascii=False, separators=(",", ":"), allow_nan=False) \
        .replace("<", "\\u003c").replace(">", "\\u003e").replace("&", "\\u0026")
    return section("Samples", "samples", f"""<div id="browser">
<div class="controls"><label>task <select id="f-task"></select></label>
<label>status <select id="f-status"><option value="">any</option><option value="not-ok">not ok</option>
<option>ok</option><option>truncated</option><option>skipped</option><option>error</option></select></label>
<label>score <select id="f-score"><option value="">any</option><option value="1">1</option>
<option value="0">0</option><option value="between">between 0 and 1</option><option value="none">not scored</option>
</select></label><label><input type="checkbox" id="f-disagree"> disagreements only</label>
<label>text <input id="f-text" size="16"></label>
<button id="f-prev">◀</button><span id="f-page"></span><button id="f-next">▶</button></div>
<p id="browser-count"></p>
<noscript><p class="note">The sample browser needs JavaScript; the rows are in this file as JSON
(script id samples-data), and in the output's Parquet files.</p></noscript>
<table id="sample-browser"><thead></thead><tbody></tbody></table></div>
<script type="application/json" id="samples-data">{payload}</script>
<script>{SCRIPT}</script>""")


def sample_rows(outputs: list[Output], limit: int = LIMIT) -> dict:
    """{"columns": [label], "tasks": {task: {"rows": N, "disagree": D, "shown": [row]}}}; a row is
    {"id", "completion", "disagree", "prompt", "target", "cells": [cell or null per column]}. Which rows
    are shown is worked out in Arrow over every row's keys; Python sees only the rows shown."""
    datasets = [committed(out.root, out.manifest) for out in outputs]
    keys = _keys(datasets)
    if keys is None:
        return {"columns": [], "tasks": {}, "limit": limit, "text_chars": TEXT_CHARS}
    pairs = keys.group_by(["output", "model"]).aggregate([]).to_pylist()
    columns = sorted((p["output"], p["model"]) for p in pairs)  # the comparison's order: by output, then model
    ranked, chosen = {}, {}
    for task in pc.unique(keys["task"]).to_pylist():
        mine = keys.filter(pc.equal(keys["task"], task))
        ranked[task] = ranking = _ranking(mine)
        shown = ranking.slice(0, limit).to_pylist()
        chosen[task] = {(r["sample_id"], r["completion"]): r["disagree"] for r in shown}
    cells = _cells(keys, chosen)
    texts = _texts(datasets, chosen)
    tasks = {}
    for task, shown in chosen.items():
        rows = []
        for key, disagree in shown.items():
            mine = cells.get((task, key), {})
            row_cells = [_cell(mine[c], texts.get((c, task, key))) if c in mine else None for c in columns]
            first = next((texts[(c, task, key)] for c in columns if (c, task, key) in texts), {})
            for cell in row_cells:  # a prompt rendered alike for every model is kept once, on the row
                if cell is not None and cell["prompt"] == first.get("prompt"):
                    del cell["prompt"]
                elif cell is not None:
                    cell["prompt"] = visible(cell["prompt"])
            rows.append({"id": visible(key[0]), "completion": key[1], "disagree": disagree,
                         "prompt": _cut(first.get("prompt")), "target": _cut(first.get("target")), "cells": row_cells})
        ranking = ranked[task]
        tasks[task] = {"rows": ranking.num_rows, "disagree": pc.sum(ranking["disagree"]).as_py() or 0, "shown": rows}
    return {"columns": [column_label(outputs, c) for c in columns], "tasks": tasks, "limit": limit,
            "text_chars": TEXT_CHARS}


def _keys(datasets: list) -> pa.Table | None:
    """Every committed row's keys, status and score, with the index of its output; None where none is."""
    parts = []
    for k, dataset in enumerate(datasets):
        if dataset is None:
            continue
        t = columns_of(dataset, KEYS)
        parts.append(pa.table({
            "output": pa.array(np.full(t.num_rows, k, dtype=np.int32)),
            "model": t["model"].cast(pa.string()), "task": t["task"].cast(pa.string()),
            "sample_id": t["sample_id"].cast(pa.string()),
            "completion": pc.fill_null(t["completion"].cast(pa.int32()), 0),  # outputs made before it was kept
            "status": t["status"].cast(pa.string()), "score": t["score"].cast(pa.float64())}))
    return pa.concat_tables(parts) if parts else None


def _ranking(rows: pa.Table) -> pa.Table:
    """One task's (sample_id, completion) keys in the page's order: where the columns disagree on score or
    status first, then where one did not come out ok, then the rest; within each, by sample id (shorter
    ids first, so q2 before q10)."""
    rows = rows.append_column("ok", pc.equal(rows["status"], "ok"))
    g = rows.group_by(["sample_id", "completion"]).aggregate([
        ("score", "count_distinct"), ("status", "count_distinct"), ("output", "count"), ("ok", "all")])
    disagree = pc.and_(pc.greater(g["output_count"], 1), pc.or_(pc.greater(g["score_count_distinct"], 1),
                                                               pc.greater(g["status_count_distinct"], 1)))
    group = pc.if_else(disagree, 0, pc.if_else(g["ok_all"], 2, 1))
    ranking = pa.table({"sample_id": g["sample_id"], "completion": g["completion"], "disagree": disagree,
                        "group": group, "id_length": pc.utf8_length(g["sample_id"])})
    return ranking.sort_by([("group", "ascending"), ("id_length", "ascending"), ("sample_id", "ascending"),
                            ("completion", "ascending")])


def _cells(keys: pa.Table, chosen: dict) -> dict:
    """(task, key) -> {column: (status, score)} for the shown rows."""
    ids = list({sid for shown in chosen.values() for sid, _ in shown})
    found: dict = defaultdict(dict)
    for r in keys.filter(pc.is_in(keys["sample_id"], pa.array(ids, pa.string()))).to_pylist():
        key = (r["sample_id"], r["completion"])
        if key in chosen.get(r["task"], ()):
            found[(r["task"], key)][(r["output"], r["model"])] = (r["status"], r["score"])
    return found


def _texts(datasets: list, chosen: dict) -> dict:
    """(column, task, key) -> the row's texts, read for the shown rows only (one scan per output)."""
    found = {}
    ids = sorted({sid for shown in chosen.values() for sid, _ in shown})
    for k, dataset in enumerate(datasets):
        if dataset is None or not ids:
            continue
        wanted = [c for c in TEXTS + ["task"] if c in dataset.schema.names]
        for r in dataset.to_table(columns=wanted, filter=pc.field("sample_id").isin(ids)).to_pylist():
            key = (r["sample_id"], r.get("completion") or 0)
            if key in chosen.get(r["task"], ()):
                found[((k, r["model"]), r["task"], key)] = r
    return found


def _cell(status_score: tuple, texts: dict | None) -> dict:
    status, score = status_score
    texts = texts or {}
    why = texts.get("error") or texts.get("exec_error")
    return {"status": status, "score": score, "output": _cut(texts.get("output_text")), "prompt": texts.get("prompt"),
            "why": _cut(why), "exec": texts.get("exec_status"), "finish": texts.get("finish_reason")}


def _finite(value):
    """`value` with each NaN or infinite float as the string "NaN", "inf" or "-inf" (the browser shows it)."""
    if isinstance(value, float) and not math.isfinite(value):
        return "NaN" if math.isnan(value) else "inf" if value > 0 else "-inf"
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    return value


def _cut(text: str | None) -> str | None:
    """A text as the page shows it: cut at TEXT_CHARS characters (of the text, before its escapes), unprintable
    characters escaped."""
    if text is None or len(text) <= TEXT_CHARS:
        return visible(text)
    return visible(text[:TEXT_CHARS]) + f"… ({len(text) - TEXT_CHARS} more characters)"


SCRIPT = r"""(function(){
const data=JSON.parse(document.getElementById('samples-data').textContent);
const $=id=>document.getElementById(id), PAGE=50; let page=0;
const tasks=Object.keys(data.tasks);
for(const t of tasks){const o=document.createElement('option');o.textContent=t;$('f-task').appendChild(o);}
function el(tag,text,cls){const e=document.createElement(tag);if(text!==undefined&&text!==null)e.textContent=text;
  if(cls)e.className=cls;return e;}
function keep(row){
  const st=$('f-status').value, sc=$('f-score').value, q=$('f-text').value.toLowerCase();
  if($('f-disagree').checked&&!row.disagree)return false;
  const cells=row.cells.filter(c=>c);
  if(st&&!cells.some(c=>st==='not-ok'?c.status!=='ok':c.status===st))return false;
  if(sc&&!cells.some(c=>sc==='none'?c.score===null:sc==='between'?(c.score!==null&&c.score>0&&c.score<1)
      :c.score===Number(sc)))return false;
  if(q&&![row.id,row.prompt,row.target].concat(cells.map(c=>c.output)).some(v=>v&&String(v).toLowerCase().includes(q)))
    return false;
  return true;}
function draw(){
  const t=data.tasks[$('f-task').value]; const rows=t.shown.filter(keep);
  const pages=Math.max(1,Math.ceil(rows.length/PAGE)); page=Math.min(page,pages-1);
  $('f-page').textContent=` page ${page+1} of ${pages} `;
  $('browser-count').textContent=`${t.rows} row(s) in this task, ${t.disagree} where the columns disagree; `+
    `${t.shown.length===t.rows?'all are':'the first '+t.shown.length+' (disagreements first) are'} in this page, `+
    `${rows.length} match the filters.`;
  const head=$('sample-browser').tHead, body=$('sample-browser').tBodies[0]; head.innerHTML='';body.innerHTML='';
  const hr=head.insertRow(); for(const h of ['sample','prompt','target'].concat(data.columns))hr.appendChild(el('th',h));
  for(const row of rows.slice(page*PAGE,(page+1)*PAGE)){
    const tr=body.insertRow(); if(row.disagree)tr.className='disagree';
    tr.appendChild(el('td',row.completion?`${row.id} #${row.completion}`:row.id));
    tr.appendChild(el('td',row.prompt,'text')); tr.appendChild(el('td',row.target,'text'));
    for(const c of row.cells){
      if(!c){tr.appendChild(el('td','—'));continue;}
      const td=el('td',null,'text');
      td.appendChild(el('b',`${c.status} · score ${c.score===null?'—':c.score}`+(c.exec?` · ${c.exec}`:'')));
      td.appendChild(document.createElement('br')); td.appendChild(document.createTextNode(c.output===null?'(no output)':c.output));
      if(c.why){td.appendChild(document.createElement('br'));td.appendChild(el('i',c.why));}
      if(c.prompt){td.appendChild(document.createElement('br'));td.appendChild(el('i','prompt: '+c.prompt));}
      tr.appendChild(td);}
  }}
for(const id of ['f-task','f-status','f-score','f-disagree','f-text'])
  $(id).addEventListener(id==='f-text'?'input':'change',()=>{page=0;draw();});
$('f-prev').onclick=()=>{page=Math.max(0,page-1);draw();}; $('f-next').onclick=()=>{page++;draw();};
draw();})();"""
