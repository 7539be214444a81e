import time, torch
from elm_memory.backends.sampling import pick_tokens, inverse_cdf, uniforms
torch.manual_seed(0)
def t(fn, n=10):
    fn(); best=1e9
    for _ in range(3):
        t0=time.perf_counter()
        for _ in range(n): fn()
        best=min(best,(time.perf_counter()-t0)/n)
    return round(best*1000,2)
for rows in (8,64):
  for dt in (torch.bfloat16, torch.float32):
    x=(torch.randn(rows,151936)*3).to(dt)
    T=torch.full((rows,),0.8); T1=torch.ones(rows)
    keys=torch.arange(rows); c=torch.zeros(rows,dtype=torch.long); tp=torch.ones(rows)
    xf=x.float()
    p=torch.softmax(xf,-1)
    r={}
    r['float()']=t(lambda: x.float())
    r['div']=t(lambda: xf/T.unsqueeze(1))
    r['softmax']=t(lambda: torch.softmax(xf,-1))
    r['amax']=t(lambda: xf.amax(-1))
    r['exp']=t(lambda: torch.exp(xf))
    r['blocksum']=t(lambda: p.view(rows,-1,128).sum(-1))
    r['inv_cdf']=t(lambda: inverse_cdf(p, uniforms(keys,c)))
    r['pick']=t(lambda: pick_tokens(x,T,tp,keys,c,any_sampled=True,any_nucleus=False,any_greedy=False))
    r['pick_T1']=t(lambda: pick_tokens(x,T1,tp,keys,c,any_sampled=True,any_nucleus=False,any_greedy=False))
    print(rows, dt, r, flush=True)
